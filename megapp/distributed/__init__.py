"""Data-parallel gradients: contiguous buffers, overlapped bucket reduction, finalize."""

from megapp.distributed.buffers import Bucket, ParamAndGradBuffer
from megapp.distributed.ddp import (
    ZERO_STAGES,
    DistributedDataParallel,
    finalize_model_grads,
    full_weights,
    needs_other_group_sum,
)

__all__ = [
    "ZERO_STAGES",
    "Bucket",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "finalize_model_grads",
    "full_weights",
    "needs_other_group_sum",
]
