"""Start a training job: torch.distributed, the layout's process groups and the seeds."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megapp import comm
from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.optimizer.clip_grads import counts_in_norm
from megapp.parallel_state import TrainGroups
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.launcher_watch import exit_with_launcher


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def initialize_distributed(config: PretrainConfig) -> torch.device:
    """Start torch.distributed (NCCL with CUDA, else gloo; torchrun's environment, or a
    world of one for a plain ``python`` launch), the layout's groups and the seeds.
    Under torchrun, the process also exits by itself if its torchrun is killed.
    Returns this rank's device."""
    exit_with_launcher(os.path.basename(sys.argv[0]) or "pretrain_gpt.py")
    parallel = config.parallel
    backend = parallel.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    if dist.get_world_size() != config.world_size:
        raise ArgumentsError(
            f"the settings were checked for {config.world_size} ranks but the job has "
            f"{dist.get_world_size()}"
        )
    ps.initialize_model_parallel(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        timeout=timeout,
    )
    model_parallel_manual_seed(config.training.seed)
    return device


def count_parameters(chunks: Sequence[DistributedDataParallel], groups: TrainGroups) -> int:
    """Parameters of the whole model, each element once (tp replicas and tied copies once)."""
    tp_rank = comm.rank(groups.tp)
    mine = sum(
        p.numel() for c in chunks for p in c.module.parameters() if counts_in_norm(p, tp_rank)
    )
    total = torch.tensor([mine], dtype=torch.float64, device=chunks[0].buffer.params[0].device)
    comm.all_reduce(total, ps.get_model_parallel_group())
    return int(total.item())
