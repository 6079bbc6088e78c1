"""Reshardable, atomic training checkpoints on ``torch.distributed.checkpoint``."""

from megapp.checkpointing.checkpoint import (
    CheckpointInfo,
    iteration_dir,
    load_checkpoint,
    read_latest,
    save_checkpoint,
)
from megapp.checkpointing.errors import CheckpointError, NoOptimizerStateError
from megapp.checkpointing.shards import TensorShard, tensor_parallel_shard

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "NoOptimizerStateError",
    "TensorShard",
    "iteration_dir",
    "load_checkpoint",
    "read_latest",
    "save_checkpoint",
    "tensor_parallel_shard",
]
