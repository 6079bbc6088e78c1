"""The model of ``bench_pipeline.py``: pipeline chunks that sleep instead of computing, and
one iteration of them under megapp's engine or torch.distributed.pipelining.

Every chunk is two tiny autograd Functions: one on the activation's path sleeps ``tf / v``
in its forward and ``(tb - tw) / v`` in its backward (the input gradient), one on a scalar
weight's path sleeps ``tw / v`` in its backward (the weight gradient), and the chunk adds
them. A whole backward runs both; a split one runs the first in ``I`` and the second in
``W``, for megapp and for torch alike (both split the autograd graph at the weight's
branch). The first stage has no input gradient to compute: its weight branch sleeps the
whole backward. So the schedule, the point-to-point messages and the autograd bookkeeping are
real while compute is a fixed, contention-free sleep. The functions that take no ``cfg``
probe the machine: the one-way point-to-point latency and the cost of a tiny op after a
sleep.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from megapp.pipeline_parallel import (
    PipelineHooks,
    TensorSpec,
    WeightStash,
    build_schedule,
    forward_backward,
)
from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS
from megapp.pipeline_parallel.channels import Channels, make_channels
from megapp.pipeline_parallel.schedules import Schedule

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining's schedule for each megapp schedule that has a peer (its
interleaved zero-bubble schedule keeps interleaved 1F1B's memory, as zb-h1 does)."""
SPIN_S = 0.0005  # the last part of a sleep is spent polling the clock


def precise_sleep(seconds: float) -> None:
    """Sleep for ``seconds``, overshooting by microseconds rather than the scheduler's slack.

    ``time.sleep`` wakes 0.2 ms late on an idle VM and later on a busy one, which would be
    counted as compute. So the thread sleeps until ``SPIN_S`` before the deadline and polls
    the clock for the rest: at most 0.5 ms of CPU per action, while the rank would compute.
    """
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class _SleepInput(torch.autograd.Function):
    """``x`` unchanged; sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s > 0:
            precise_sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            precise_sleep(ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """``w`` unchanged; sleeps ``backward_s`` in backward (the weight gradient)."""

    @staticmethod
    def forward(ctx, weight, backward_s):
        ctx.backward_s = backward_s
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            precise_sleep(ctx.backward_s)
        return grad, None


class SleepChunk(nn.Module):
    """One model chunk: fixed forward, input-gradient and weight-gradient times and one
    scalar parameter."""

    def __init__(self, forward_s: float, input_grad_s: float, weight_grad_s: float):
        super().__init__()
        self.forward_s, self.input_grad_s = forward_s, input_grad_s
        self.weight_grad_s = weight_grad_s
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # the first stage: no input gradient, the whole backward
            path = _SleepInput.apply(x, self.forward_s, 0.0)  # is the weights'
            return path + _SleepWeight.apply(self.weight, self.input_grad_s + self.weight_grad_s)
        path = _SleepInput.apply(x, self.forward_s, self.input_grad_s)
        return path + _SleepWeight.apply(self.weight, self.weight_grad_s)


@dataclass
class Config:
    schedule: str
    m: int
    v: int
    tf: float  # per pipeline stage (all its chunks together), seconds
    tb: float  # a whole backward: input gradient tb - tw, then weight gradient tw
    tw: float = 0.0
    first_scale: float = 1.0  # the first virtual stage's times, times this (an embedding)
    last_scale: float = 1.0  # the last virtual stage's (an output layer and the loss)
    iterations: int = 1  # per call: the asynchronous schedules run them without a flush

    @property
    def label(self) -> str:
        runs = f" x{self.iterations} iterations" if self.asynchronous else ""
        return f"{self.schedule} m={self.m} v={self.v}{runs}"

    @property
    def asynchronous(self) -> bool:
        kind = SCHEDULE_KINDS.get(self.schedule)
        return kind is not None and kind.asynchronous

    @property
    def v_shape(self) -> bool:
        kind = SCHEDULE_KINDS.get(self.schedule)
        return kind is not None and kind.v_shaped


def iteration(run: Callable, record: bool = False) -> tuple[float, object]:
    """One iteration on every rank: barrier, the call, the slowest rank's time (s) and the
    call's result."""
    dist.barrier()
    start = time.perf_counter()
    out = run(record=record)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), out


def _data(cfg: Config, micro_batch_size: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (cfg.m * (cfg.iterations if cfg.asynchronous else 1) * micro_batch_size, hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _chunks(cfg: Config) -> list[SleepChunk]:
    p, rank, v = dist.get_world_size(), dist.get_rank(), cfg.v
    chunks = []
    for c in range(v):
        stage = stage_of(cfg, p, rank, c)
        scale = (cfg.first_scale if stage == 0 else 1.0) * (
            cfg.last_scale if stage == p * v - 1 else 1.0
        )
        times = (cfg.tf / v, (cfg.tb - cfg.tw) / v, cfg.tw / v)
        chunks.append(SleepChunk(*(t * scale for t in times)))
    return chunks


def stage_of(cfg: Config, p: int, rank: int, chunk: int) -> int:
    """The virtual stage chunk ``chunk`` of ``rank`` runs: looped, or the V."""
    if cfg.v_shape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def _forward_step(iterator, chunk, inputs):
    x, target = next(iterator)
    out = chunk(x if inputs is None else inputs[0])
    return out, lambda output: F.mse_loss(output, target)


def megapp_runner(
    cfg: Config,
    micro_batch_size: int,
    hidden: int,
    declared: bool = True,
    schedule: Schedule | None = None,
    strict_p2p: bool = False,
) -> Callable[..., object]:
    """``run(record)``: one megapp iteration on this rank, returning its PipelineResult.

    ``strict_p2p``: the messages travel over strict channels, under NCCL's rules
    (:mod:`megapp.pipeline_parallel.strict_p2p`); made once, by every rank together.

    ``declared`` passes the activation shape as ``tensor_shapes``; otherwise the engine
    negotiates shapes per message (its default). ``schedule`` replaces ``cfg.schedule``'s
    (a searched one). An asynchronous schedule runs ``cfg.iterations`` iterations per call,
    its steps doing nothing but keep the weight versions."""
    x, target = _data(cfg, micro_batch_size, hidden)
    batches = list(zip(x.split(micro_batch_size), target.split(micro_batch_size), strict=True))
    chunks = _chunks(cfg)
    shapes = [TensorSpec((micro_batch_size, hidden), torch.float32)] if declared else None
    if cfg.asynchronous:
        p = dist.get_world_size()
        schedule = schedule or build_schedule(cfg.schedule, p, cfg.m, iterations=cfg.iterations)
    hooks = PipelineHooks(update=lambda step: None) if cfg.asynchronous else None
    stash = WeightStash()
    channels = strict_channels() if strict_p2p else None

    def run(record: bool = False):
        return forward_backward(
            _forward_step,
            [iter(batches) for _ in chunks],
            chunks,
            len(batches),
            schedule=schedule or cfg.schedule,
            tensor_shapes=shapes,
            record=record,
            hooks=hooks,
            weight_stash=stash,
            channels=channels,
        )

    return run


_STRICT: list[Channels] = []


def strict_channels() -> Channels:
    """The whole world's pipeline as strict channels, made on first use (collective)."""
    if not _STRICT:
        _STRICT.append(make_channels([list(range(dist.get_world_size()))], strict=True))
    return _STRICT[0]


def torch_runner(cfg: Config, micro_batch_size: int, hidden: int) -> Callable[..., object]:
    """``run(record)``: one torch.distributed.pipelining iteration on this rank (never records).

    Shapes are static (``input_args``/``output_args``), as megapp's ``tensor_shapes``."""
    from torch.distributed import pipelining

    rank, p = dist.get_rank(), dist.get_world_size()
    x, target = _data(cfg, micro_batch_size, hidden)
    chunks = _chunks(cfg)

    def example(needs_grad: bool) -> torch.Tensor:
        return torch.empty(micro_batch_size, hidden, requires_grad=needs_grad)

    stages = [
        pipelining.PipelineStage(
            chunk,
            stage_of(cfg, p, rank, c),
            p * cfg.v,
            torch.device("cpu"),
            input_args=example(stage_of(cfg, p, rank, c) > 0),
            output_args=example(True),
        )
        for c, chunk in enumerate(chunks)
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[cfg.schedule])
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, cfg.m, loss_fn=F.mse_loss)
    last_rank = 0 if cfg.v_shape else p - 1
    first, last = rank == 0, rank == last_rank

    def run(record: bool = False):
        inputs = (x,) if first else ()
        schedule.step(*inputs, target=target if last else None, return_outputs=False)

    return run


def p2p_latency(micro_batch_size: int, hidden: int, pause: float, rounds: int) -> float:
    """One-way latency of one activation between ranks 0 and 1: half the median round trip.

    With ``pause`` > 0 rank 0 sleeps before each round, so the message finds its peer idle
    in a wait, as in a pipeline whose ranks sleep; on a VM waking an idle peer costs far
    more than a back-to-back ping-pong shows.
    """
    rank = dist.get_rank()
    buf = torch.zeros(micro_batch_size, hidden)

    def one(op, peer):
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
            work.wait()

    times = []
    for _ in range(rounds):
        if rank == 0 and pause > 0:
            time.sleep(pause)
        start = time.perf_counter()
        if rank == 0:
            one(dist.isend, 1)
            one(dist.irecv, 1)
        elif rank == 1:
            one(dist.irecv, 0)
            one(dist.isend, 0)
        times.append(time.perf_counter() - start)
    dist.barrier()
    latency = torch.tensor([statistics.median(times) / 2 if rank == 0 else 0.0])
    dist.broadcast(latency, 0)
    return latency.item()


def cold_op_cost(pause: float, rounds: int = 30) -> float:
    """Median time of one tiny torch op (``x + w`` on an 8 x 256 tensor) run right after
    ``pause`` seconds of sleep, as every action of a sleep-mode iteration runs.

    On some VMs code and data not touched for a few milliseconds come back slowly (this
    one: about 2 us back to back, about 0.1 ms after 10 ms or more), so an action's own
    Python and torch work costs several times more after its sleep than in a loop; this
    puts that figure next to the results it explains."""
    x, w = torch.randn(8, 256), torch.zeros(())
    times = []
    for _ in range(rounds):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        x + w
        times.append(time.perf_counter() - start)
    return statistics.median(times)
