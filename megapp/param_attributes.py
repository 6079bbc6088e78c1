"""What a parameter records about its place in the layout, set and read in one place.

The layers mark their parameters; data parallelism, the optimizer's norm, checkpoints and
conversion tools read the marks:

- **tensor parallel** (:func:`set_tensor_parallel`): this rank holds a slice along
  ``partition_dim``; with ``stride`` s the dimension holds s interleaved parts, each split
  over the ranks (SwiGLU's fused ``[gate; up]`` weight);
- **padded vocabulary** (:func:`set_unpadded_size`): only the first rows of the whole
  dimension are real, the rest is padding for the layout;
- **sequence parallel** (:func:`mark_sequence_parallel`): replicated over tensor-parallel
  ranks that each saw only their part of the sequence, so the gradient is a partial sum;
- **expert parallel** (:func:`mark_expert_parallel`): one of the experts of a
  mixture-of-experts layer, which the expert-parallel ranks split among them: it is
  replicated over the expert-data-parallel group only, where its gradient is reduced;
- **tied embedding** (:func:`mark_tied_embedding`): one of the two copies of the word
  embedding on the first and last pipeline stage; the last stage's is a *duplicate*.

:func:`gather_tensor_parallel` puts a parameter (or any tensor of its shape, such as its
gradient or an optimizer state) back together: whole, unpadded, on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group

__all__ = [
    "gather_tensor_parallel",
    "is_duplicate",
    "is_expert_parallel",
    "is_sequence_parallel",
    "is_tensor_parallel",
    "is_tied_embedding",
    "mark_expert_parallel",
    "mark_sequence_parallel",
    "mark_tied_embedding",
    "partition",
    "set_tensor_parallel",
    "set_unpadded_size",
    "shard",
    "unpadded_size",
    "unshard",
]


def set_tensor_parallel(param: nn.Parameter, partition_dim: int, stride: int, tp_size: int) -> None:
    """``param`` is this rank's slice of a weight split over ``tp_size`` ranks along
    ``partition_dim`` (a whole weight when ``tp_size`` is 1; its parts still show)."""
    param.tensor_model_parallel = tp_size > 1
    param.partition_dim = partition_dim
    param.partition_stride = stride


def set_unpadded_size(param: nn.Parameter, rows: int) -> None:
    """Only the first ``rows`` of ``param``'s whole partition dimension are real."""
    param.unpadded_size = rows


def mark_sequence_parallel(param: nn.Parameter, enabled: bool = True) -> None:
    """Each tensor-parallel rank computed ``param``'s gradient from its sequence shard only."""
    param.sequence_parallel = enabled


def mark_expert_parallel(param: nn.Parameter) -> None:
    """``param`` holds this rank's experts (or their expert-tensor-parallel shards)."""
    param.expert_parallel = True


def is_expert_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def mark_tied_embedding(param: nn.Parameter, duplicate: bool) -> None:
    """``param`` is a copy of the tied word embedding; ``duplicate`` for the last stage's
    copy, which the gradient norm leaves out (the first stage's counts)."""
    param.shared_embedding = True
    param.shared = duplicate


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Split over more than one tensor-parallel rank."""
    return getattr(param, "tensor_model_parallel", False)


def partition(param: torch.Tensor) -> tuple[int, int] | None:
    """``(partition_dim, stride)`` of a parameter marked by :func:`set_tensor_parallel`,
    None for one that is not."""
    if not hasattr(param, "partition_dim"):
        return None
    return param.partition_dim, getattr(param, "partition_stride", 1)


def unpadded_size(param: torch.Tensor) -> int | None:
    """The real rows of a padded vocabulary dimension, or None."""
    return getattr(param, "unpadded_size", None)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, "sequence_parallel", False)


def is_tied_embedding(param: torch.Tensor) -> bool:
    return getattr(param, "shared_embedding", False)


def is_duplicate(param: torch.Tensor) -> bool:
    """A copy of a parameter another rank holds too (the tied embedding on the last stage)."""
    return getattr(param, "shared", False)


def shard(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` along ``dim``.

    With ``stride`` s the dimension is cut into ``world·s`` blocks and a rank
    keeps blocks ``rank, rank + world, ...``: a fused ``[gate; up]`` weight
    (stride 2) then gives every rank matching gate and up columns.
    """
    blocks = full.chunk(world * stride, dim=dim)
    return torch.cat(blocks[rank::world], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every rank's part, in rank order."""
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([b[i] for i in range(stride) for b in blocks], dim=dim)


def gather_tensor_parallel(
    tensor: torch.Tensor, param: nn.Parameter, tp_group: Group
) -> torch.Tensor:
    """``tensor`` (``param`` itself, its gradient or a state of its shape) as the whole,
    unpadded tensor, on every rank of ``tp_group``. Collective over ``tp_group`` for a
    tensor-parallel parameter; otherwise ``tensor`` itself (unpadded)."""
    if tensor.shape != param.shape:
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} for a {tuple(param.shape)} param"
        )
    full = tensor
    if is_tensor_parallel(param):
        dim, stride = partition(param)
        world = comm.world_size(tp_group)
        gathered = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        comm.all_gather_into(gathered, tensor.contiguous(), tp_group)
        full = unshard(list(gathered.chunk(world)), dim, stride)
    rows = unpadded_size(param)
    return full if rows is None else full.narrow(partition(param)[0], 0, rows)
