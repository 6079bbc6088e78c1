"""One way to build what training needs on this rank: model chunks wrapped for data
parallelism, the optimizer and the learning-rate schedule, for the current layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp import parallel_state as ps
from megapp.distributed import ZERO_STAGES, DistributedDataParallel
from megapp.models import GPTConfig, build_gpt_chunks
from megapp.optimizer import ConstantGradScaler, DynamicGradScaler, LRScheduler, Optimizer
from megapp.parallel_state import TrainGroups
from megapp.pipeline_parallel.schedules import Schedule
from megapp.training.flag_groups import OptimizerArgs, PrecisionArgs
from megapp.transformer.config import ExpertGroups

ChunkBuilder = Callable[[TrainGroups], list[nn.Module]]
"""``groups -> this rank's model chunks`` (chunk ``c`` is its ``c``-th virtual stage)."""


@dataclass
class TrainingSetup:
    """This rank's part of a training run."""

    chunks: list[DistributedDataParallel]
    optimizer: Optimizer
    scheduler: LRScheduler
    groups: TrainGroups


def build_grad_scaler(precision: PrecisionArgs):
    """The fp16 loss scaler the settings ask for (None for bf16 and fp32)."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return ConstantGradScaler(precision.loss_scale)
    return DynamicGradScaler(
        initial_scale=precision.initial_loss_scale,
        min_scale=precision.min_loss_scale,
        growth_interval=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )


def build_training_setup(
    model: GPTConfig | ChunkBuilder,
    optimizer: OptimizerArgs,
    *,
    precision: PrecisionArgs | None = None,
    bucket_size: int | None = 40_000_000,
    zero_stage: int = 0,
    overlap_grad_reduce: bool = True,
    seed: int = 1234,
    device: torch.device | str = "cpu",
    schedule: str | Schedule | None = None,
    stages: Sequence[int] | None = None,
    per_stage_steps: bool = False,
) -> TrainingSetup:
    """Chunks, optimizer and schedule of this rank under the current
    :mod:`megapp.parallel_state` layout (call ``initialize_model_parallel`` first; a single
    process without one gets the whole model).

    ``model``: a GPTConfig (this rank's GPT chunks are built from ``seed``), or a provider
    that returns this rank's chunks. ``optimizer.lr_decay_iters`` must be set (the config
    built from flags sets it). The layout's groups (:class:`TrainGroups`) are handed to the
    chunks and the optimizer. ``zero_stage``: 1 shards the optimizer states over
    data-parallel ranks (Megatron's distributed optimizer), 2 also the gradients, 3 also
    the weights. ``overlap_grad_reduce``: reduce each gradient bucket as soon as the last
    microbatch's backward fills it (else all of them after that backward).
    ``schedule``: the pipeline schedule (a name or a
    :class:`~megapp.pipeline_parallel.schedules.Schedule`) whose placement the GPT chunks
    are built for (default the looped one); ``stages``: this rank's virtual stages given
    directly instead. ``per_stage_steps``: each pipeline stage steps its optimizer on its
    own (the asynchronous schedules), which refuses what cannot run so
    (:func:`~megapp.optimizer.optimizer.check_per_stage_steps`).
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
    if optimizer.lr_decay_iters is None:
        raise ValueError("optimizer.lr_decay_iters must be set (the run's length, usually)")
    precision = precision or PrecisionArgs()
    if ps.model_parallel_is_initialized():
        groups, grid = TrainGroups.from_parallel_state(), ps.get_grid()
        pp_rank, pp, vpp = comm.rank(groups.pp), grid.pp, grid.vpp
    elif dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "build_training_setup needs megapp.parallel_state's layout in a job of "
            f"{dist.get_world_size()} ranks; call initialize_model_parallel() first"
        )
    else:  # one process, no layout: the whole model, nothing to communicate
        groups, pp_rank, pp, vpp = TrainGroups(), 0, 1, None
    if isinstance(model, GPTConfig):
        modules = build_gpt_chunks(
            model,
            pp_rank=pp_rank,
            pp_size=pp,
            vpp_size=vpp,
            tp_group=groups.tp,
            seed=seed,
            schedule=schedule,
            stages=stages,
            cp_group=groups.cp,
            expert_groups=ExpertGroups(groups.ep, groups.expt_tp, groups.tp_cp),
        )
    else:
        modules = model(groups)
    chunks = [
        DistributedDataParallel(
            module.to(device),
            dp_group=groups.dp_cp,  # the replicas of these weights
            bucket_size=bucket_size,
            zero_stage=zero_stage,
            overlap_grad_reduce=overlap_grad_reduce,
            expert_dp_group=groups.expt_dp,  # the replicas of the experts
        )
        for module in modules
    ]
    # Every rank of the expert norm group sums the experts' share, whether its stage has
    # experts or not: asked of a mixture-of-experts model (or chunks holding experts).
    experts = any(c.expert_params for c in chunks)
    if isinstance(model, GPTConfig):
        experts = model.num_moe_experts is not None
    # The ranks that together hold every gradient once: sharded, every rank holds a slice.
    sharded = zero_stage >= 1 and dist.is_initialized()
    adamw = Optimizer(
        chunks,
        lr=optimizer.lr,
        weight_decay=optimizer.weight_decay,
        betas=(optimizer.adam_beta1, optimizer.adam_beta2),
        eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad or None,
        grad_scaler=build_grad_scaler(precision),
        tp_group=groups.tp,
        norm_group=dist.group.WORLD if sharded else groups.mp,
        per_stage=per_stage_steps,
        pp_group=groups.pp,
        expert_norm_group=(dist.group.WORLD if sharded else groups.tp_ep_pp) if experts else None,
        expert_tp_group=groups.expt_tp,
    )
    scheduler = LRScheduler(
        adamw,
        max_lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        warmup_steps=optimizer.lr_warmup_iters,
        decay_steps=optimizer.lr_decay_iters,
        decay_style=optimizer.lr_decay_style,
    )
    return TrainingSetup(chunks, adamw, scheduler, groups)
