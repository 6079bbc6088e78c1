"""Data-parallel gradient reduction overlapped with backward.

:class:`DistributedDataParallel` wraps one model chunk. Each parameter's
gradient is added into its fp32 ``main_grad`` as soon as autograd has it (a
post-accumulate hook; ``param.grad`` is then released). While gradient sync is
enabled (the last microbatch's backward), a bucket whose gradients are all in
starts its reduction asynchronously, so communication runs under the rest of
backward; on other microbatches gradients only accumulate (no sync).

The reduction averages over the data-parallel group: an all-reduce, or with
the distributed optimizer a reduce-scatter that leaves each rank the summed
slice it owns. Buckets marked late (parameters that must first be summed over
another group) are reduced by :meth:`sync_late_grads` after that sum. Experts of a
mixture-of-experts layer (marked expert parallel) are replicated over the
expert-data-parallel group only: they sit in a buffer of their own, divided by the same
data-parallel size and summed over that group (see :class:`DistributedDataParallel`);
every ZeRO stage shards them over that group.

ZeRO stages (one value, :data:`ZERO_STAGES`): 0 all-reduces whole gradients; 1 (the
distributed optimizer) reduce-scatters them once per step; 2 also keeps only this rank's
slice of the gradients, reduce-scattering every microbatch
(:mod:`~megapp.distributed.sharded_grads`); 3 also keeps only this rank's slice of the
weights (:mod:`~megapp.distributed.sharded_params`).

:func:`finalize_model_grads` is the one post-backward step over every chunk: these
reductions, and the sums over other groups that some parameters need first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.distributed.buffers import Bucket, ParamAndGradBuffer
from megapp.distributed.sharded_grads import ShardedGrads
from megapp.distributed.sharded_params import ShardedParams, layer_units
from megapp.parallel_state import layout_group
from megapp.param_attributes import is_expert_parallel, is_sequence_parallel, is_tied_embedding

ZERO_STAGES = (0, 1, 2, 3)
"""0: plain data parallelism; 1: optimizer states sharded over data-parallel ranks (the
distributed optimizer); 2: and the gradients; 3: and the weights."""


def needs_other_group_sum(param: nn.Parameter) -> bool:
    """Parameters whose gradient is also summed over the tensor-parallel group (replicated
    under sequence parallelism) or the embedding group (tied embedding copies)."""
    return is_sequence_parallel(param) or is_tied_embedding(param)


class DistributedDataParallel(nn.Module):
    """One model chunk with bucketed, overlapped data-parallel gradient reduction.

    Args:
        module: the model chunk; its parameters become views into a flat buffer.
        dp_group: the data-parallel group. ``None``: the data-parallel group of
            :mod:`megapp.parallel_state`'s layout, or one replica (nothing to reduce) in a
            job of one rank; in a larger job without a layout it must be given.
        bucket_size: elements per bucket (``None``: one bucket per chunk).
        zero_stage: one of :data:`ZERO_STAGES`: from 1, reduce-scatter instead of
            all-reduce (the distributed optimizer); from 2, keep only this rank's slice of
            the reduced gradients; 3, also only this rank's slice of the weights, gathering
            a layer's when it runs.
        overlap_grad_reduce: start a bucket's reduction as soon as it is ready; False
            reduces everything in :meth:`finish_grad_sync`.
        is_late: which parameters are reduced last (default :func:`needs_other_group_sum`).
        expert_dp_group: the expert-data-parallel group, over which expert parameters
            are reduced (``None``: ``dp_group``, right without an expert layout).

    Expert gradients: every rank's loss is its share of the data-parallel mean (dense
    gradients are divided by ``dp`` and summed). An expert shard's gradient on one rank
    already sums the contributions of every token routed to it from the ranks of its
    expert (tensor-)parallel group, and those groups tile the ranks of the expert-data-
    parallel group: dividing by the same ``dp`` and summing over ``expert_dp_group`` gives
    the mean over all replicas, the single-process gradient. Every ZeRO stage shards the
    experts over ``expert_dp_group`` as it shards the rest over ``dp_group``: stage 1 their
    optimizer states (a reduce-scatter there), 2 their gradients too, 3 their weights too,
    each with a :class:`ShardedGrads` and :class:`ShardedParams` of the expert buffer.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        dp_group: Group = None,
        bucket_size: int | None = 40_000_000,
        zero_stage: int = 0,
        overlap_grad_reduce: bool = True,
        is_late: Callable[[nn.Parameter], bool] = needs_other_group_sum,
        expert_dp_group: Group = None,
    ):
        super().__init__()
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
        if dp_group is None:
            dp_group = layout_group(
                "dp", "DistributedDataParallel needs dp_group (the ranks that hold replicas)"
            )
        self.module = module
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = comm.world_size(dp_group), comm.rank(dp_group)
        self.zero_stage = zero_stage
        self.overlap_grad_reduce = overlap_grad_reduce
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        experts = [p for p in params if is_expert_parallel(p)]
        params = [p for p in params if not is_expert_parallel(p)]
        self.expert_dp_group = dp_group if expert_dp_group is None else expert_dp_group
        self.expert_dp_size = comm.world_size(self.expert_dp_group)
        self.expert_dp_rank = comm.rank(self.expert_dp_group)
        sharded = zero_stage >= 2 and self.dp_size > 1
        stage3 = zero_stage == 3 and sharded
        experts_sharded = bool(experts) and zero_stage >= 2 and self.expert_dp_size > 1
        experts_stage3 = zero_stage == 3 and experts_sharded
        units, unit_of = layer_units(module) if stage3 or experts_stage3 else ({}, None)
        self.buffer = ParamAndGradBuffer(
            params,
            bucket_size=bucket_size,
            dp_size=self.dp_size,
            is_late=is_late,
            allocate_grads=not sharded,
            unit_of=unit_of if stage3 else None,
            bucket_storage=stage3,
        )
        self.expert_buffer = (
            ParamAndGradBuffer(
                experts,
                bucket_size=bucket_size,
                dp_size=self.expert_dp_size,
                allocate_grads=not experts_sharded,
                unit_of=unit_of if experts_stage3 else None,
                bucket_storage=experts_stage3,
            )
            if experts
            else None
        )
        self._expert_buckets = {id(b) for b in self.expert_buffer.buckets} if experts else set()
        self._expert_ids = {id(p) for p in experts}
        self.sharded = (
            ShardedGrads(self.buffer, dp_group, self.buffer.grad_dtype) if sharded else None
        )
        self.sharded_params = (
            ShardedParams(self.buffer, dp_group, units, unit_of) if stage3 else None
        )
        # ZeRO-2/3 of the experts: over their own group, with the dense 1/dp scaling
        self.expert_sharded = (
            ShardedGrads(
                self.expert_buffer,
                self.expert_dp_group,
                self.expert_buffer.grad_dtype,
                divide_by=self.dp_size,
            )
            if experts_sharded
            else None
        )
        self.expert_sharded_params = (
            ShardedParams(self.expert_buffer, self.expert_dp_group, units, unit_of)
            if experts_stage3
            else None
        )
        self._dense_side = _Side(
            self.buffer, dp_group, self.dp_rank, self.dp_size, self.sharded, self.sharded_params
        )
        self._expert_side = _Side(
            self.expert_buffer,
            self.expert_dp_group,
            self.expert_dp_rank,
            self.expert_dp_size,
            self.expert_sharded,
            self.expert_sharded_params,
        )
        # What finalize_model_grads sums over another group first, read once from the marks.
        self.sequence_parallel_params = [p for p in self.buffer.params if is_sequence_parallel(p)]
        self.tied_embedding_params = [p for p in self.buffer.params if is_tied_embedding(p)]
        self.grad_sync = True
        hooked = params + experts
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in hooked]
        self.buffer.reset()
        if self.expert_buffer is not None:
            self.expert_buffer.reset()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # ----- gradient arrival ------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a split backward's I deferred this weight: nothing came
            return
        expert = id(param) in self._expert_ids
        sharded = self.expert_sharded if expert else self.sharded
        if sharded is not None:  # ZeRO-2/3
            sharded.accumulate(param)
            param.grad = None
            return
        param.main_grad.add_(param.grad)
        param.grad = None  # the buffer holds it now
        if not (self.grad_sync and self.overlap_grad_reduce):
            return
        bucket = (self.expert_buffer if expert else self.buffer).bucket_of[id(param)]
        bucket.pending.discard(id(param))
        if not bucket.pending and not bucket.late:
            self._start(bucket)

    def set_grad_sync(self, enabled: bool) -> None:
        """Enable reduction for the backward passes that follow (the last microbatch)."""
        self.grad_sync = enabled

    def settle_grads(self) -> None:
        """After a backward: under ZeRO-2/3 wait for the reductions it started and free
        their whole gradients, so none outlives the backward (a no-op otherwise)."""
        for _, sharded in self._grad_stores():
            if sharded is not None:
                sharded.settle()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them."""
        before, self.grad_sync = self.grad_sync, False
        try:
            yield
        finally:
            self.grad_sync = before

    # ----- reduction -------------------------------------------------------
    @property
    def expert_params(self) -> list[nn.Parameter]:
        """The expert parameters, reduced over the expert-data-parallel group."""
        return [] if self.expert_buffer is None else self.expert_buffer.params

    def _start_experts(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            return
        grads = self.expert_buffer.grad_data[bucket.start : bucket.end]
        if self.dp_size > 1:
            grads.div_(self.dp_size)  # the same 1/dp share as the dense gradients
        group = self.expert_dp_group
        if self.expert_dp_size == 1:
            bucket.work = _DONE
        elif self.zero_stage >= 1:
            lo, hi = bucket.shard(self.expert_dp_rank, self.expert_dp_size)
            out = self.expert_buffer.grad_data[lo:hi]
            bucket.work = comm.reduce_scatter_into(out, grads, group, async_op=True)
        else:
            bucket.work = comm.all_reduce(grads, group, async_op=True)

    def _start(self, bucket: Bucket) -> None:
        if id(bucket) in self._expert_buckets:
            self._start_experts(bucket)
            return
        if bucket.work is not None or self.dp_size == 1:
            return
        grads = self.buffer.grad_data[bucket.start : bucket.end]
        grads.div_(self.dp_size)  # sum of 1/dp-scaled gradients: the data-parallel mean
        if self.zero_stage >= 1:
            lo, hi = bucket.shard(self.dp_rank, self.dp_size)
            out = self.buffer.grad_data[lo:hi]
            bucket.work = comm.reduce_scatter_into(out, grads, self.dp_group, async_op=True)
        else:
            bucket.work = comm.all_reduce(grads, self.dp_group, async_op=True)

    def _finish(self, late: bool) -> None:
        buckets = []
        for buffer, sharded in self._grad_stores():
            if sharded is not None:  # ZeRO-2/3
                sharded.finish(late)
            else:
                buckets += buffer.buckets
        for bucket in buckets:
            if bucket.late == late:
                self._start(bucket)
        for bucket in buckets:
            if bucket.late == late and bucket.work is not None:
                bucket.work.wait()
                bucket.work = True  # done; not started again until reset

    def finish_grad_sync(self) -> None:
        """Start the buckets not started yet, and wait for all but the late ones. (Backward
        is over: ZeRO-3 frees whatever weights are still whole.)"""
        self._finish(late=False)
        for weights in self._weight_stores():
            weights.reset()

    def sync_late_grads(self) -> None:
        """Reduce the late buckets (after their other-group sums)."""
        self._finish(late=True)

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """``param``'s data-parallel mean gradient, whole and shaped like ``param``, after
        :meth:`finish_grad_sync` (and :meth:`sync_late_grads` for late parameters).

        From ZeRO stage 1 on each rank holds only its reduce-scattered slice of every
        bucket: the slices of ``param``'s bucket are all-gathered over the data-parallel
        group, so every rank of it must call this for the same parameters in the same
        order. Otherwise ``param.main_grad`` itself.
        """
        side = self._side(param)
        if self.zero_stage == 0 or side.size == 1:
            return param.main_grad
        bucket = side.buffer.bucket_of[id(param)]
        if side.grads is not None:
            own = side.grads.owned(bucket)
        else:
            lo, hi = bucket.shard(side.rank, side.size)
            own = side.buffer.grad_data[lo:hi]
        whole = own.new_empty(bucket.end - bucket.start)
        comm.all_gather_into(whole, own, side.group)
        start, end = side.buffer.ranges[id(param)]
        return whole[start - bucket.start : end - bucket.start].view(param.shape)

    def _side(self, param: nn.Parameter) -> _Side:
        """Where ``param`` lives: the expert buffer and group, or the dense ones."""
        return self._expert_side if id(param) in self._expert_ids else self._dense_side

    def _grad_stores(self) -> list[tuple[ParamAndGradBuffer, ShardedGrads | None]]:
        """Each buffer (dense, then the experts' if any) with its ZeRO-2 slice store."""
        stores = [(self.buffer, self.sharded)]
        if self.expert_buffer is not None:
            stores.append((self.expert_buffer, self.expert_sharded))
        return stores

    def _weight_stores(self) -> list[ShardedParams]:
        """The ZeRO-3 weight slices of the dense and the expert buffer (those sharded)."""
        stores = (self.sharded_params, self.expert_sharded_params)
        return [s for s in stores if s is not None]

    def resized_storages(self) -> list[torch.UntypedStorage]:
        """Storages this chunk resizes in place between uses (ZeRO-3's weight buckets, freed
        to zero bytes at rest), for memory accounting; none without ZeRO-3."""
        buckets = [b for weights in self._weight_stores() for b in weights.buffer.buckets]
        return [b.param_data.untyped_storage() for b in buckets]

    def owned_weights(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The weights of elements ``[lo, hi)`` of ``param`` (flat) that this rank updates:
        a view of the parameter, or of its ZeRO-3 slice."""
        side = self._side(param)
        if side.weights is None:
            return param.data.view(-1)[lo:hi]
        bucket, span = self._in_slice(side, param, lo, hi)
        return side.weights.shard_of(bucket)[span]

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """A context in which every weight is whole (ZeRO-3 gathers them, the experts' too;
        what is written into them is kept); otherwise nothing to do."""
        with contextlib.ExitStack() as stack:
            for weights in self._weight_stores():
                stack.enter_context(weights.gathered())
            yield

    def owned_grad(self, param: nn.Parameter, lo: int, hi: int) -> torch.Tensor:
        """The reduced gradient of elements ``[lo, hi)`` of ``param`` (flat), which this rank
        updates: a slice of ``main_grad``, or of the ZeRO-2 slice store."""
        side = self._side(param)
        if side.grads is None:
            return param.main_grad.view(-1)[lo:hi]
        bucket, span = self._in_slice(side, param, lo, hi)
        return side.grads.owned(bucket)[span]

    @staticmethod
    def _in_slice(side: _Side, param: nn.Parameter, lo: int, hi: int) -> tuple[Bucket, slice]:
        """``param``'s bucket, and where its elements ``[lo, hi)`` sit in this rank's slice
        of that bucket (they must be ones this rank owns)."""
        bucket = side.buffer.bucket_of[id(param)]
        offset = side.buffer.ranges[id(param)][0] - bucket.shard(side.rank, side.size)[0]
        return bucket, slice(offset + lo, offset + hi)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage this chunk holds now."""
        total = 0
        for buffer, sharded in self._grad_stores():
            if sharded is not None:
                total += sharded.grad_bytes()
            else:
                total += buffer.grad_data.numel() * buffer.grad_data.element_size()
        return total

    def zero_grad_buffer(self) -> None:
        """Zero ``main_grad`` and re-arm the buckets; call before each iteration."""
        for p in [*self.buffer.params, *self.expert_params]:
            p.grad = None
        for buffer, sharded in self._grad_stores():
            buffer.reset()
            if sharded is not None:
                sharded.reset()
        for weights in self._weight_stores():
            weights.reset()


@dataclass
class _Side:
    """The dense or the expert half of a chunk: its buffer, the group that reduces (and
    from stage 1 shards) it, this rank's place there, and its ZeRO-2/3 stores (or None)."""

    buffer: ParamAndGradBuffer | None  # None: a chunk without experts
    group: Group
    rank: int
    size: int
    grads: ShardedGrads | None
    weights: ShardedParams | None


class _Done:
    """A reduction with nothing to wait for (an expert-data-parallel group of one rank)."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


@contextlib.contextmanager
def full_weights(chunks) -> Iterator[None]:
    """Every chunk's weights whole while the block runs (ZeRO-3 chunks gather them and keep
    what the block writes); plain modules and other stages need nothing."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            if isinstance(chunk, DistributedDataParallel):
                stack.enter_context(chunk.full_weights())
        yield


def _all_reduce_coalesced(grads: list[torch.Tensor], group: Group) -> None:
    if not grads or comm.world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    torch._foreach_copy_(
        grads,
        [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)],
    )


def finalize_model_grads(
    chunks: Sequence[DistributedDataParallel],
    *,
    tp_group: Group = None,
    embedding_group: Group = None,
) -> None:
    """After the last backward of an iteration:

    1. wait for the data-parallel reduction of every regular bucket;
    2. sum the gradients of sequence-parallel replicated parameters (norm weights,
       row-parallel biases) over the tensor-parallel group, each rank having seen
       only its part of the sequence;
    3. sum the tied word-embedding gradient over the embedding group (first and
       last pipeline stage), so both copies take the same step; when both stages
       live on this rank (a V-shaped placement) the two copies are summed here;
    4. reduce the late buckets holding those parameters over data-parallel ranks.
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    sequence_parallel = [p.main_grad for c in chunks for p in c.sequence_parallel_params]
    if sequence_parallel and tp_group is None:
        raise ValueError(
            "the model is sequence parallel but no tp_group was given: its norm and bias "
            "gradients would miss the other tensor-parallel ranks' tokens"
        )
    _all_reduce_coalesced(sequence_parallel, tp_group)
    embedding = [p.main_grad for c in chunks for p in c.tied_embedding_params]
    if len(embedding) > 2:
        raise ValueError("a rank holds the tied embedding at most twice (first and last stage)")
    if len(embedding) == 2:  # a V-shaped placement: first and last stage on this rank
        embedding[0].add_(embedding[1])
        embedding[1].copy_(embedding[0])
        embedding = []
    if embedding and embedding_group is None:
        raise ValueError(
            "the word embedding is tied across pipeline stages but no embedding_group was "
            "given: its two copies would take different steps"
        )
    _all_reduce_coalesced(embedding, embedding_group)
    for chunk in chunks:
        chunk.sync_late_grads()
