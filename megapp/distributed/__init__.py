"""Data-parallel gradients: contiguous buffers, overlapped bucket reduction, finalize."""

from megapp.distributed.buffers import Bucket, ParamAndGradBuffer
from megapp.distributed.ddp import DistributedDataParallel, full_weights, needs_other_group_sum
from megapp.distributed.finalize import finalize_model_grads

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "finalize_model_grads",
    "full_weights",
    "needs_other_group_sum",
]
