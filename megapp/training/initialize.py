"""Start a training job: torch.distributed, the layout's process groups and the seeds."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megapp import comm
from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.launcher_watch import exit_with_launcher
from megapp.optimizer.clip_grads import counts_in_norm
from megapp.parallel_state import TrainGroups
from megapp.param_attributes import is_expert_parallel
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.live_memory import available_bytes


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def backend_of(config: PretrainConfig) -> str:
    """``--distributed-backend``, else NCCL with CUDA and gloo without."""
    chosen = config.parallel.distributed_backend
    return chosen or ("nccl" if torch.cuda.is_available() else "gloo")


def rank_device(config: PretrainConfig) -> torch.device:
    """This rank's device: its node's GPU number ``LOCAL_RANK`` under NCCL, else the CPU."""
    if backend_of(config) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_memory(config: PretrainConfig, vocab_size: int) -> None:
    """Refuse, before any rank starts, a model whose weights, gradients and optimizer states
    alone (the planner's count) exceed what this rank's device has free; on CPU, this
    node's ranks together against the machine's available memory."""
    from megapp.planning.memory import predict_memory
    from megapp.process_grid import ProcessGrid

    device = rank_device(config)
    available = available_bytes(device)
    if available is None:
        return
    parallel = config.parallel
    grid = ProcessGrid(
        config.world_size,
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
    )
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    sharing = [rank]
    if device.type == "cpu":
        first = rank - local
        last = first + int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sharing = range(first, min(last, config.world_size))
    state = [r.state for r in predict_memory(config, vocab_size)]
    needed = sum(state[grid.pipeline_stage(r)] for r in sharing)
    if needed <= available:
        return
    where = f"GPU {device.index}" if device.type == "cuda" else "this machine"
    ranks = f"{len(sharing)} ranks' " if len(sharing) > 1 else ""
    raise ArgumentsError(
        f"the model does not fit in memory: {ranks}weights, gradients and optimizer states "
        f"need {needed / 2**30:.1f} GiB but {where} has {available / 2**30:.1f} GiB free; "
        "split it over more ranks (--tensor-model-parallel-size, "
        "--pipeline-model-parallel-size), shard its optimizer states (--zero-stage) or "
        "shrink the model"
    )


@contextlib.contextmanager
def start_up_timeout(config: PretrainConfig, waiting_for: str) -> Iterator[None]:
    """Turn the job's timeout running out in a start-up wait (``waiting_for`` says on
    what: every rank still imports, joins or builds its caches there, often for longer than
    a collective of a running job should wait) into an :class:`ArgumentsError` naming the
    flag to raise."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as error:  # the store's, gloo's and NCCL's timeouts, CollectiveError
        if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
            raise
        minutes = config.parallel.distributed_timeout_minutes
        raise ArgumentsError(
            f"--distributed-timeout-minutes {minutes:g} ({_seconds(60 * minutes)}) is too "
            f"short for start-up: rank {os.environ.get('RANK', '0')} gave up after "
            f"{_seconds(time.monotonic() - started)} waiting for {waiting_for}; raise "
            "--distributed-timeout-minutes"
        ) from None


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 1 else f"{value:.3f} s"


def initialize_distributed(config: PretrainConfig) -> torch.device:
    """Start torch.distributed (NCCL with CUDA, else gloo; torchrun's environment, or a
    world of one for a plain ``python`` launch), the layout's groups and the seeds.
    Under torchrun, the process also exits by itself if its torchrun is killed.
    Returns this rank's device."""
    exit_with_launcher(os.path.basename(sys.argv[0]) or "pretrain_gpt.py")
    parallel = config.parallel
    backend = backend_of(config)
    device = rank_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    with start_up_timeout(config, "the other ranks to join"):
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
            context_parallel_size=parallel.context_parallel_size,
            strict_p2p=parallel.strict_p2p,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        )
    groups = TrainGroups.from_parallel_state()
    model_parallel_manual_seed(config.training.seed, comm.rank(groups.tp), comm.rank(groups.pp))
    return device


def count_parameters(chunks: Sequence[DistributedDataParallel], groups: TrainGroups) -> int:
    """Parameters of the whole model, each element once (tp replicas and tied copies once;
    experts summed over the expert layout's ranks that hold one copy of each)."""
    tp_rank = comm.rank(groups.tp)
    params = [p for c in chunks for p in c.module.parameters()]
    dense = sum(
        p.numel() for p in params if not is_expert_parallel(p) and counts_in_norm(p, tp_rank)
    )
    total = torch.tensor([dense], dtype=torch.float64, device=chunks[0].buffer.params[0].device)
    comm.all_reduce(total, groups.mp)
    # every rank of a mixture-of-experts model joins, whether its stage has experts or not
    configs = [getattr(c.module, "config", None) for c in chunks]
    if all(getattr(config, "num_moe_experts", None) is None for config in configs):
        return int(total.item())
    etp_rank = comm.rank(groups.expt_tp)
    experts = sum(
        p.numel() for p in params if is_expert_parallel(p) and counts_in_norm(p, etp_rank)
    )
    expert_total = torch.tensor([experts], dtype=torch.float64, device=total.device)
    comm.all_reduce(expert_total, groups.tp_ep_pp)
    return int(total.item() + expert_total.item())
