"""Helpers shared by the distributed tests."""

import torch
import torch.distributed as dist

from megapp.param_attributes import gather_tensor_parallel, is_sequence_parallel, unshard


def gather(t: torch.Tensor, group, dim: int, stride: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's part along ``dim``."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return unshard(parts, dim, stride)


def full_grad(param: torch.nn.Parameter, group) -> torch.Tensor:
    """The gradient of the whole parameter, however it is split or replicated."""
    if group is None:
        return param.grad
    grad = gather_tensor_parallel(param.grad, param, group)
    if is_sequence_parallel(param):  # each rank saw only its sequence shard
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
    return grad
