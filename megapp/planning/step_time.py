"""One predicted iteration assembled from the simulated timeline: its time, throughput,
model FLOPs utilisation and where the time goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.simulate import Timeline
from megapp.planning.hardware import Hardware
from megapp.training.config import PretrainConfig
from megapp.training.flops import gpt_training_flops

if TYPE_CHECKING:
    from megapp.planning.timing import ActionCosts


@dataclass(frozen=True)
class StepTime:
    """A predicted iteration: its time, throughput and where the time goes (seconds)."""

    seconds: float
    bubble: float  # idle share of the pipeline ranks' time during the schedule
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float  # model FLOPs (recompute not counted), 10^12/s per device
    mfu: float | None  # against the hardware's peak; None without one
    timeline: Timeline = field(repr=False)
    breakdown: dict[str, float] = field(default_factory=dict)


def rank_finish(costs: ActionCosts, timeline: Timeline) -> list[float]:
    """When every pipeline rank is done: its last action, then its tail (which for an
    asynchronous schedule is in its steps, among the actions)."""
    ends = timeline.rank_ends()
    if timeline.schedule.asynchronous:
        return ends
    return [end + tail for end, tail in zip(ends, costs.tail, strict=True)]


def step_time(
    config: PretrainConfig,
    gpt: GPTConfig,
    costs: ActionCosts,
    timeline: Timeline,
    hardware: Hardware,
) -> StepTime:
    """Assemble a :class:`StepTime` from ``costs`` and the schedule's simulated ``timeline``
    (of one iteration, or of an asynchronous run of several: its time per iteration)."""
    p = config.schedule.num_stages
    iterations = timeline.schedule.iterations
    finish = rank_finish(costs, timeline)
    seconds = max(finish) / iterations + hardware.step_overhead
    slowest = finish.index(max(finish))
    m, world = config.num_microbatches, config.world_size
    tokens = config.training.global_batch_size * config.model.seq_length
    flops = gpt_training_flops(gpt, config.model.seq_length, tokens)
    per_gpu = flops / seconds / world
    replica_flops = m * sum(
        sum(map(sum, t))
        for t in (costs.flops_forward, costs.flops_input_grad, costs.flops_weight_grad)
    )
    par = config.parallel
    ranks = par.tensor_model_parallel_size * par.context_parallel_size * config.data_parallel_size
    hardware_flops = replica_flops * ranks
    breakdown = {
        "pipeline": timeline.makespan / iterations,
        "busiest_rank": max(costs.busy(r, m, config.schedule.splits_backward) for r in range(p)),
        "tensor_parallel": m * max(sum(row) for row in costs.tensor_parallel),
        "context_parallel": m * max(sum(row) for row in costs.context_parallel),
        "p2p_message": costs.p2p,
        "data_parallel": costs.grad_reduce[slowest],
        "optimizer": costs.optimizer[slowest],
        "tail": costs.tail[slowest],
        "step_overhead": hardware.step_overhead,
        "recompute_flops": hardware_flops - flops,
    }
    return StepTime(
        seconds=seconds,
        bubble=timeline.bubble_fraction,
        tokens_per_second_per_gpu=tokens / seconds / world,
        tflops_per_gpu=per_gpu / 1e12,
        mfu=None if hardware.peak_flops is None else per_gpu / hardware.peak_flops,
        timeline=timeline,
        breakdown=breakdown,
    )
