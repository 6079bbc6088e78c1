"""Autograd collectives between the tensor-parallel ranks (Megatron's f and g).

Each takes its tensor-parallel group explicitly; ``None`` means no tensor
parallelism (one rank), where every mapping is the identity and returns its
input itself, with no autograd node (one rank pays nothing for the mappings). Tensors are
``[s, b, h]``: the "last dimension" is the hidden one split by tensor
parallelism, dimension 0 the sequence one split by sequence parallelism.
"""

from __future__ import annotations

import torch

from megapp.comm import (
    Group,
    all_gather_into,
    all_reduce,
    rank,
    reduce_scatter_into,
    world_size,
)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    # A copy: the input may be autograd's own buffer or used elsewhere.
    x = x.clone(memory_format=torch.contiguous_format)
    all_reduce(x, group)
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = world_size(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the {world} TP ranks")
    return x.chunk(world, dim=-1)[rank(group)].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = world_size(group)
    if world == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0; move the last dim there and back.
    moved = x.movedim(-1, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    all_gather_into(out, moved, group)
    return out.movedim(0, -1).contiguous()


def split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's slice of dimension 0 (the sequence)."""
    world = world_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by the {world} TP ranks; "
            "sequence parallelism needs it to be"
        )
    return x.chunk(world, dim=0)[rank(group)].contiguous()


def gather_first(x: torch.Tensor, group: Group, async_op: bool = False):
    """All-gather along dimension 0; with ``async_op`` returns ``(tensor, work)``."""
    world = world_size(group)
    if world == 1:
        return (x, None) if async_op else x
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    work = all_gather_into(out, x, group, async_op)
    return (out, work) if async_op else out


def reduce_scatter_first(x: torch.Tensor, group: Group, async_op: bool = False):
    """Sum over ranks, keep this rank's slice of dimension 0; with ``async_op`` returns
    ``(tensor, work)``."""
    world = world_size(group)
    if world == 1:
        return (x, None) if async_op else x
    if x.shape[0] % world:
        raise ValueError(f"dimension 0 ({x.shape[0]}) is not divisible by the {world} TP ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    work = reduce_scatter_into(out, x, group, async_op)
    return (out, work) if async_op else out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f. Forward: identity. Backward: all-reduce the gradient."""
    if world_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """g. Forward: all-reduce (sum of partial results). Backward: identity."""
    if world_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""
    if world_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's slice of it."""
    if world_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: keep this rank's slice of the sequence (dim 0). Backward: all-gather dim 0."""
    if world_size(group) == 1:
        return x
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Forward: all-gather the sequence (dim 0). Backward: reduce-scatter along dim 0."""
    if world_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """Forward: sum over ranks and keep this rank's slice of dim 0. Backward: all-gather dim 0."""
    if world_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group)
