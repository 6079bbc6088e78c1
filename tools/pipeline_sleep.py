"""The model of ``tools/bench_pipeline.py``: pipeline chunks that sleep instead of computing,
and one iteration of them under megapp's engine or torch.distributed.pipelining.

Every chunk is a tiny autograd Function that sleeps ``tf / v`` in its forward and ``tb / v``
in its backward and adds a scalar weight to a small activation, so the schedule, the
point-to-point messages and the autograd bookkeeping are real while compute is a fixed,
contention-free sleep. The functions that take no ``cfg`` probe the machine: the one-way
point-to-point latency and the cost of a tiny op after a sleep.
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

from megapp.pipeline_parallel import TensorSpec, forward_backward

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}
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


class _Sleep(torch.autograd.Function):
    """``x + w`` that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s > 0:
            precise_sleep(forward_s)
        return x + weight

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            precise_sleep(ctx.backward_s)
        grad_x = grad if ctx.needs_input_grad[0] else None
        return grad_x, grad.sum(), None, None


class SleepChunk(nn.Module):
    """One model chunk: a fixed forward and backward time and one scalar parameter."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.forward_s, self.backward_s)


@dataclass
class Config:
    schedule: str
    m: int
    v: int
    tf: float  # per pipeline stage (all its chunks together), seconds
    tb: float

    @property
    def label(self) -> str:
        return f"{self.schedule} m={self.m} v={self.v}"


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
    shape = (cfg.m * micro_batch_size, hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _chunks(cfg: Config) -> list[SleepChunk]:
    return [SleepChunk(cfg.tf / cfg.v, cfg.tb / cfg.v) for _ in range(cfg.v)]


def _forward_step(iterator, chunk, inputs):
    x, target = next(iterator)
    out = chunk(x if inputs is None else inputs[0])
    return out, lambda output: F.mse_loss(output, target)


def megapp_runner(
    cfg: Config, micro_batch_size: int, hidden: int, declared: bool = True
) -> Callable[..., object]:
    """``run(record)``: one megapp iteration on this rank, returning its PipelineResult.

    ``declared`` passes the activation shape as ``tensor_shapes``; otherwise the engine
    negotiates shapes per message (its default)."""
    x, target = _data(cfg, micro_batch_size, hidden)
    batches = list(zip(x.split(micro_batch_size), target.split(micro_batch_size), strict=True))
    chunks = _chunks(cfg)
    shapes = [TensorSpec((micro_batch_size, hidden), torch.float32)] if declared else None

    def run(record: bool = False):
        return forward_backward(
            _forward_step,
            [iter(batches) for _ in chunks],
            chunks,
            cfg.m,
            schedule=cfg.schedule,
            tensor_shapes=shapes,
            record=record,
        )

    return run


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
            c * p + rank,
            p * cfg.v,
            torch.device("cpu"),
            input_args=example(c * p + rank > 0),
            output_args=example(True),
        )
        for c, chunk in enumerate(chunks)
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[cfg.schedule])
    schedule = cls(stages if cfg.v > 1 else stages[0], cfg.m, loss_fn=F.mse_loss)
    first, last = rank == 0, rank == p - 1

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
