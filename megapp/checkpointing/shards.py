"""A tensor's piece of a larger, layout-independent tensor, in the form DCP saves and loads.

``torch.distributed.checkpoint`` stores every tensor as chunks of a global tensor,
each chunk named by its offsets, and on load reads whatever overlaps the chunks
the loading ranks ask for. :class:`TensorShard` tells it which chunk a local
tensor is: a tensor-parallel slice of a parameter becomes the rows (or columns)
``[r·n, (r+1)·n)`` of the whole parameter, so a checkpoint written under one
tensor-parallel size reads under any other.

Two layouts need more than an offset:

- a slice taken with stride ``s`` (the SwiGLU ``fc1`` holds ``s`` interleaved
  parts, each split over the ranks) is viewed as ``[s, n, ...]``: part ``k`` of
  rank ``r`` is ``[k, r·n : (r+1)·n]`` of a global ``[s, N, ...]``;
- a vocabulary padded to a multiple of the tensor-parallel size keeps only its
  real rows: the global tensor has ``unpadded_size`` rows whatever the padding,
  and a rank whose rows are all padding holds nothing of it;
- a rank's ``L`` experts, stacked ``[L, ...]`` (and split over expert tensor
  parallelism like any tensor-parallel weight), are rows ``[e·L, (e+1)·L)`` of
  all ``E`` experts ``[E, ...]`` on expert-parallel rank ``e``: each expert is
  stored under its global index, whatever the expert-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megapp.param_attributes import (
    is_expert_parallel,
    is_tensor_parallel,
    partition,
    unpadded_size,
)


class TensorShard(torch.Tensor):
    """``local`` placed at ``offsets`` inside a tensor of shape ``global_shape``.

    It only describes; DCP reads from and writes into ``local`` itself (no copy), so a
    shard over a parameter's storage loads the parameter in place.
    """

    local: torch.Tensor
    offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets, global_shape) -> TensorShard:
        offsets, global_shape = torch.Size(offsets), torch.Size(global_shape)
        if len(offsets) != local.dim() or len(global_shape) != local.dim():
            raise ValueError(
                f"offsets {tuple(offsets)} and global shape {tuple(global_shape)} must have "
                f"one entry per dimension of the local {tuple(local.shape)}"
            )
        if any(o + n > g for o, n, g in zip(offsets, local.shape, global_shape, strict=True)):
            raise ValueError(
                f"a {tuple(local.shape)} piece at {tuple(offsets)} does not fit in "
                f"{tuple(global_shape)}"
            )
        if not local.is_contiguous():
            raise ValueError("a checkpoint shard must be contiguous")
        shard = torch.Tensor._make_wrapper_subclass(
            cls, global_shape, dtype=local.dtype, device=local.device
        )
        shard.local, shard.offsets = local, offsets
        return shard

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)

    # The hooks DCP's planners look for on tensors that are pieces of a bigger one.
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and torch.Size(index.offset) != self.offsets:
            raise ValueError(f"{index.fqn}: no piece at {tuple(index.offset)} on this rank")
        return self.local

    def __repr__(self) -> str:
        return (
            f"TensorShard(local={tuple(self.local.shape)}, offsets={tuple(self.offsets)}, "
            f"global={tuple(self.shape)}, dtype={self.dtype})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a TensorShard only describes a checkpoint piece; {func} is not defined")


def tensor_parallel_shard(
    tensor: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int
) -> TensorShard | None:
    """``tensor`` (``param`` itself or a state of the same shape) as a piece of the whole
    parameter, from ``param``'s tensor-parallel attributes; None when this rank holds only
    vocabulary padding."""
    if tensor.shape != param.shape:
        raise ValueError(f"state of shape {tuple(tensor.shape)} for a {tuple(param.shape)} param")
    if not is_tensor_parallel(param):
        tp_rank, tp_size = 0, 1  # whole on every rank (a strided weight still shows its parts)
    unpadded, parts = unpadded_size(param), partition(param)
    if parts is None or (tp_size == 1 and parts[1] == 1 and unpadded is None):
        return TensorShard(tensor, [0] * tensor.dim(), tensor.shape)
    dim, stride = parts
    n = tensor.shape[dim]
    if unpadded is not None:
        if stride != 1:
            raise ValueError("a padded vocabulary dimension cannot also be strided")
        start = tp_rank * n
        keep = max(0, min(n, unpadded - start))
        if keep == 0:
            return None
        local = tensor.narrow(dim, 0, keep)
        offsets = [0] * tensor.dim()
        offsets[dim] = start
        shape = list(tensor.shape)
        shape[dim] = unpadded
        return TensorShard(local, offsets, shape)
    if n % stride:
        raise ValueError(f"dimension {dim} of size {n} does not split into {stride} strided parts")
    part = n // stride
    local_shape = [*tensor.shape[:dim], stride, part, *tensor.shape[dim + 1 :]]
    offsets = [0] * len(local_shape)
    offsets[dim + 1] = tp_rank * part
    global_shape = list(local_shape)
    global_shape[dim + 1] = part * tp_size
    if stride == 1:  # no extra dimension
        del local_shape[dim], offsets[dim], global_shape[dim]
    return TensorShard(tensor.view(local_shape), offsets, global_shape)


def expert_parallel_shard(
    tensor: torch.Tensor,
    param: torch.nn.Parameter,
    etp_rank: int,
    etp_size: int,
    ep_rank: int,
    ep_size: int,
) -> TensorShard:
    """``tensor`` (an expert ``param`` ``[L, ...]`` or a state of its shape) as a piece of
    every expert's ``[E, ...]``, ``E = L·ep_size``: its expert-tensor-parallel piece
    (:func:`tensor_parallel_shard` over the etp ranks) moved to rows ``ep_rank·L``."""
    if not is_expert_parallel(param):
        raise ValueError(f"a {tuple(param.shape)} param that holds no experts")
    shard = tensor_parallel_shard(tensor, param, etp_rank, etp_size)
    local = shard.local.shape[0]  # the experts' dimension is never a partition dimension
    offsets, shape = list(shard.offsets), list(shard.shape)
    offsets[0], shape[0] = ep_rank * local, local * ep_size
    return TensorShard(shard.local, offsets, shape)
