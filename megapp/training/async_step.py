"""Several training iterations without a flush: PipeDream and PipeDream-2BW.

The asynchronous schedules (:mod:`megapp.pipeline_parallel.asynchronous`) step each
pipeline stage's optimizer among the pipeline's actions, so one call runs a whole run
of iterations: :func:`train_run` builds the run's schedule and gives the engine an
``update`` hook that does, per stage, what :func:`~megapp.training.step.train_step`
does once per iteration for the whole model: finish the data-parallel reduction and
the tensor-parallel sums, step (the gradient norm is the stage's own), zero the
gradients, and advance the learning rate once per iteration's worth of steps. The
weight versions in flight live in a
:class:`~megapp.pipeline_parallel.weight_stash.WeightStash` that outlives the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from megapp import comm
from megapp.distributed.ddp import DistributedDataParallel, finalize_model_grads
from megapp.optimizer.optimizer import Optimizer
from megapp.parallel_state import TrainGroups
from megapp.pipeline_parallel import PipelineHooks, forward_backward
from megapp.pipeline_parallel.catalog import asynchronous_run
from megapp.pipeline_parallel.compute import ForwardStepFunc
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.weight_stash import WeightStash
from megapp.training.config import PretrainConfig
from megapp.training.step import TrainStepResult, moe_losses, routed_tokens, set_aux_loss_scale


def run_length(config: PretrainConfig, iteration: int) -> int:
    """How many iterations the run after ``iteration`` takes: up to
    ``--pipeline-flush-interval``, ending where the loop evaluates, saves or exits, at
    ``--train-iters``, and around ``--profile-iteration``, whose timeline is of it alone;
    the memory measured after it is of the whole run that follows."""
    training, logging = config.training, config.logging
    intervals = (logging.eval_interval if logging.eval_iters else 0,)
    intervals += (config.checkpoint.save_interval or 0, training.exit_interval or 0)
    ends = [i for n in intervals if n for i in range(n, training.train_iters, n)]
    if logging.profile_iteration is not None:
        target = logging.profile_iteration
        ends += [target - 1, target]
    end = min(iteration + config.parallel.pipeline_flush_interval, training.train_iters)
    return min([e for e in ends if iteration < e < end] + [end]) - iteration


def train_run(
    forward_step_func: ForwardStepFunc,
    data_iterators: Iterator | Sequence[Iterator],
    chunks: Sequence[DistributedDataParallel],
    optimizer: Optimizer,
    *,
    schedule: Schedule,
    iterations: int,
    groups: TrainGroups,
    stash: WeightStash,
    lr_scheduler=None,
    tensor_shapes=None,
    record: bool = False,
) -> list[tuple[TrainStepResult, float]]:
    """Run ``iterations`` iterations of the asynchronous ``schedule`` (its one-iteration
    form, as the config builds it) without a flush; return each iteration's result and
    the learning rate its last step applied, identical on every rank. ``loss`` is the
    mean over the iteration's microbatches and data-parallel replicas; ``grad_norm`` the
    norm, over every stage, of the gradients its last step applied. ``optimizer`` steps
    each stage on its own (``per_stage``), which refuses what cannot run so."""
    if not optimizer.per_stage:  # a per-stage optimizer refuses clipping, ZeRO, fp16, ties
        raise ValueError(
            f"{schedule.name} steps each pipeline stage on its own: build the optimizer with "
            "per_stage=True (build_training_setup(..., per_stage_steps=True))"
        )
    if any(getattr(m, "expert_bias", None) is not None for c in chunks for m in c.modules()):
        # a recomputed forward would route with a bias moved since the microbatch's forward
        raise ValueError(f"{schedule.name} cannot move an expert bias: its stages step alone")
    run = asynchronous_run(schedule, iterations)
    m = run.num_microbatches // iterations
    steps_per_iteration = m // run.update_interval
    norms: list[float] = []
    rates: list[float] = []
    for chunk in chunks:
        chunk.zero_grad_buffer()
    # mixture-of-experts layers: their auxiliary losses averaged as each step's loss is
    set_aux_loss_scale(chunks, comm.world_size(groups.cp) / run.microbatches_per_update)

    def update(step: int) -> None:
        finalize_model_grads(chunks, tp_group=groups.tp, embedding_group=None)
        lr = optimizer.param_groups[0]["lr"]
        norms.append(optimizer.step().grad_norm)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        if (step + 1) % steps_per_iteration == 0:
            rates.append(lr)
            if lr_scheduler is not None:
                lr_scheduler.step()

    hooks = PipelineHooks(
        before_backward=lambda c, is_last: chunks[c].set_grad_sync(is_last), update=update
    )
    result = forward_backward(
        forward_step_func,
        data_iterators,
        list(chunks),
        m * iterations,
        schedule=run,
        pp_group=groups.pp,
        channels=groups.pp_channels,
        tensor_shapes=tensor_shapes,
        hooks=hooks,
        record=record,
        weight_stash=stash,
    )
    # Per iteration: the last stage's mean loss, and each stage's squared norm of its
    # iteration's last step, summed over the pipeline; then the mean over replicas.
    losses = torch.zeros(iterations, dtype=torch.float64)
    if result.microbatch_losses:
        per_microbatch = torch.stack(result.microbatch_losses).double().reshape(iterations, m)
        losses += per_microbatch.mean(dim=1)
    last = norms[steps_per_iteration - 1 :: steps_per_iteration]
    squares = torch.tensor([n * n for n in last], dtype=torch.float64)
    if comm.world_size(groups.pp) > 1:
        comm.all_reduce(losses, groups.pp)
        comm.all_reduce(squares, groups.pp)
    replicas = comm.world_size(groups.dp_cp)  # each cp rank's loss is cp × its share
    if replicas > 1:
        comm.all_reduce(losses, groups.dp_cp)
        losses /= replicas
    events = [result.events] + [[]] * (iterations - 1)  # the run's timeline, once
    # a mixture-of-experts model's auxiliary losses and expert load: the run's mean
    aux = moe_losses(chunks, groups, routed_tokens(chunks, groups))
    rows = zip(losses.tolist(), squares.tolist(), rates, events, strict=True)
    return [
        (TrainStepResult(loss, math.sqrt(square), False, timeline, aux), rate)
        for loss, square, rate, timeline in rows
    ]
