"""Start a training job: process groups and seeds, then the model chunks, optimizer and
learning-rate schedule of this rank."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.optimizer import ConstantGradScaler, DynamicGradScaler, LRScheduler, Optimizer
from megapp.optimizer.clip_grads import counts_in_norm
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training.arguments import ArgumentsError
from megapp.training.launcher_watch import exit_with_launcher
from megapp.training.step import TrainGroups

ModelProvider = Callable[[argparse.Namespace, TrainGroups], list[nn.Module]]
"""``(args, groups) -> this rank's model chunks`` (chunk ``c`` is virtual stage ``c·pp + rank``)."""


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def initialize_distributed(args: argparse.Namespace) -> torch.device:
    """Start torch.distributed (NCCL with CUDA, else gloo; torchrun's environment, or a
    world of one for a plain ``python`` launch), the layout's groups and the seeds.
    Under torchrun, the process also exits by itself if its torchrun is killed.
    Returns this rank's device."""
    exit_with_launcher(os.path.basename(sys.argv[0]) or "pretrain_gpt.py")
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    if dist.get_world_size() != args.world_size:
        raise ArgumentsError(
            f"the arguments were checked for {args.world_size} ranks but the job has "
            f"{dist.get_world_size()}"
        )
    ps.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        timeout=timeout,
    )
    model_parallel_manual_seed(args.seed)
    return device


def setup_model_and_optimizer(
    args: argparse.Namespace, model_provider: ModelProvider, groups: TrainGroups, device
) -> tuple[list[DistributedDataParallel], Optimizer, LRScheduler]:
    """This rank's chunks wrapped for data parallelism, the optimizer and the LR schedule."""
    chunks = [
        DistributedDataParallel(
            chunk.to(device),
            dp_group=groups.dp,
            bucket_size=args.ddp_bucket_size,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        for chunk in model_provider(args, groups)
    ]
    scaler = None
    if args.fp16 and args.loss_scale is not None:
        scaler = ConstantGradScaler(args.loss_scale)
    elif args.fp16:
        scaler = DynamicGradScaler(
            initial_scale=args.initial_loss_scale,
            min_scale=args.min_loss_scale,
            growth_interval=args.loss_scale_window,
            hysteresis=args.hysteresis,
        )
    optimizer = Optimizer(
        chunks,
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        clip_grad=args.clip_grad or None,
        grad_scaler=scaler,
        tp_group=groups.tp,
        # the ranks that together hold every gradient once
        norm_group=dist.group.WORLD
        if args.use_distributed_optimizer
        else ps.get_model_parallel_group(),
    )
    scheduler = LRScheduler(
        optimizer,
        max_lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.lr_warmup_iters,
        decay_steps=args.lr_decay_iters,
        decay_style=args.lr_decay_style,
    )
    return chunks, optimizer, scheduler


def count_parameters(chunks: Sequence[DistributedDataParallel], groups: TrainGroups) -> int:
    """Parameters of the whole model, each element once (tp replicas and tied copies once)."""
    tp_rank = dist.get_rank(groups.tp) if groups.tp is not None else 0
    mine = sum(
        p.numel() for c in chunks for p in c.module.parameters() if counts_in_norm(p, tp_rank)
    )
    total = torch.tensor([mine], dtype=torch.float64, device=chunks[0].buffer.param_data.device)
    comm.all_reduce(total, ps.get_model_parallel_group())
    return int(total.item())
