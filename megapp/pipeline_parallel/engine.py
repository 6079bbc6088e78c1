"""Run any pipeline schedule on real processes.

The engine walks this rank's steps of the communication plan
(:mod:`megapp.pipeline_parallel.messages`) through a
:class:`~megapp.pipeline_parallel.runner.StageRunner`: post the step's sends
and receives, wait for the receives, run the step's action; sends finish in
the background. Which tensors go where follows from the schedule; the engine
holds no schedule-specific code.

The user's ``forward_step_func(data_iterator, model_chunk, inputs)`` runs one
microbatch through one chunk. ``inputs`` is ``None`` on the first virtual
stage (the function reads its batch from the iterator) and the tuple of
tensors received from the previous stage otherwise. It returns the chunk's
output (a tensor or a tuple of tensors) and, on the last stage, a function
mapping that output to the microbatch's mean loss.

A model builder (:func:`~megapp.models.gpt.build_gpt_chunks`) marks each chunk with
the virtual stage it was built for and, where it knows it, the whole pipeline's
placement (``placement[rank][chunk]``; :func:`mark_chunk_stage`).
:func:`check_chunk_stages` runs before the engine sends anything: a chunk built for
another stage (a V-shaped schedule run on chunks built for the looped placement, say)
would otherwise fail with a shape error on one rank while its peers wait for it. Since
every rank's chunks record the same placement, every rank sees the mistake, even one
whose own chunks happen to sit where the schedule wants them, and all of them raise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from megapp import comm
from megapp.pipeline_parallel.catalog import build_schedule, default_schedule
from megapp.pipeline_parallel.channels import Channels
from megapp.pipeline_parallel.compute import ForwardStepFunc, PipelineHooks, StageCompute
from megapp.pipeline_parallel.messages import (
    Message,
    Step,
    communication_plan,
    delivered_sends,
)
from megapp.pipeline_parallel.p2p import ActivationShapes, TensorSpec, Transport
from megapp.pipeline_parallel.runner import StageRunner
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import Event
from megapp.pipeline_parallel.split_backward import SplitBackwardCompute
from megapp.pipeline_parallel.weight_stash import StashingCompute, WeightStash

__all__ = [
    "PipelineHooks",
    "PipelineResult",
    "check_chunk_stages",
    "chunk_stage",
    "forward_backward",
    "get_forward_backward_func",
    "mark_chunk_stage",
]

Placement = tuple[tuple[int, ...], ...]


@dataclass
class PipelineResult:
    """What one call of :func:`forward_backward` measured.

    loss: mean microbatch loss of the iteration, identical on every rank of the
        pipeline (a 0-dim float tensor).
    microbatch_losses: per-microbatch losses; only on the rank holding the last stage.
    peak_in_flight: most microbatch activations this rank held at once.
    events: this rank's timeline when recording was asked for.
    weight_versions: most weight versions this rank held at once, the current ones
        included (1 but for the asynchronous schedules).
    weight_copies: most frozen copies of its weights this rank kept beside the live ones.
    schedule: the schedule that ran (built from its name when a name was given).
    """

    loss: torch.Tensor
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    peak_in_flight: int = 0
    events: list[Event] = field(default_factory=list)
    weight_versions: int = 1
    weight_copies: int = 0
    schedule: Schedule | None = None


@functools.lru_cache(maxsize=64)
def _plan(schedule: Schedule) -> tuple[list[list[Step]], list[list[tuple[Message, ...]]]]:
    """The validated plan and its proven deliveries, once per schedule: a plan whose ranks
    would wait on each other forever is refused here, before any message goes out."""
    plan = communication_plan(schedule)
    return plan, delivered_sends(plan)


def forward_backward(
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator | Sequence[Iterator] | None,
    model_chunks: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    *,
    schedule: str | Schedule | None = None,
    pp_group: dist.ProcessGroup | None = None,
    tensor_shapes: Sequence[TensorSpec] | None = None,
    forward_only: bool = False,
    hooks: PipelineHooks | None = None,
    record: bool = False,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    weight_stash: WeightStash | None = None,
    channels: Channels | None = None,
) -> PipelineResult:
    """Run one iteration (forward and backward of ``num_microbatches``) on this rank.

    Args:
        forward_step_func: ``(data_iterator, model_chunk, inputs) -> (output, loss_func)``.
        data_iterator: one iterator, or one per model chunk.
        model_chunks: this rank's model chunk(s); chunk ``c`` runs the virtual stage the
            schedule places there (``c·p + rank`` for the looped schedules); a chunk that
            records another stage (:func:`mark_chunk_stage`) is refused before anything
            is sent.
        num_microbatches: microbatches per iteration.
        schedule: a name from :data:`~megapp.pipeline_parallel.catalog.SCHEDULE_KINDS` or
            a :class:`Schedule`; default the catalog's for the number of chunks (1f1b, or
            interleaved-1f1b with several).
        pp_group: the pipeline group (default: the whole world; ``None`` without
            torch.distributed means one stage).
        tensor_shapes: the shapes and dtypes every stage sends, if fixed; ``None``
            negotiates them per message, so sequence length may change freely.
        forward_only: run the forwards only (evaluation), without keeping graphs.
        hooks: see :class:`PipelineHooks`.
        record: keep this rank's timeline of actions and waits in the result.
        device: where received tensors live (default: cuda if available, else cpu).
        timeout: seconds to wait for one batch of messages before failing (default:
            the process group's timeout), so a dead or stuck peer fails this rank too.
        weight_stash: for an asynchronous schedule (PipeDream, 2BW), the weight versions
            this rank keeps; pass the same one to every call so that 2BW's delay spans
            them (a fresh one starts it afresh).
        channels: the pipeline's one-way groups (:mod:`~megapp.pipeline_parallel.channels`),
            which messages take on NCCL (required there) and, given, on gloo; strict ones
            (``make_channels(..., strict=True)``) order each group's messages on gloo as
            NCCL does, so what would deadlock on NCCL deadlocks on CPU too.

    Gradients accumulate into the chunks' parameters as ``d(mean loss)/dθ``.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, Sequence) else [model_chunks]
    if isinstance(data_iterator, Sequence):
        if len(data_iterator) != len(chunks):
            raise ValueError(
                f"got {len(data_iterator)} data iterators for {len(chunks)} model chunks; "
                "pass one iterator per chunk or a single one"
            )
        iterators = list(data_iterator)
    else:
        iterators = [data_iterator] * len(chunks)
    distributed = dist.is_available() and dist.is_initialized()
    p = dist.get_world_size(pp_group) if distributed else 1
    pp_rank = dist.get_rank(pp_group) if distributed else 0
    if isinstance(schedule, Schedule):  # built once, by its caller
        schedule.check_sizes(p, num_microbatches, len(chunks))
        sched = schedule
    else:
        name = schedule or default_schedule(len(chunks))
        sched = build_schedule(name, p, num_microbatches, len(chunks))
    check_chunk_stages(sched, pp_rank, chunks)  # before any message, so no peer waits
    if forward_only:
        sched = sched.without_backward()
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    if record and distributed and p > 1:
        comm.barrier(pp_group)  # one time origin for every rank's timeline
    origin = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - origin

    runner: StageRunner | None = None

    def on_wait(start: float, end: float) -> None:
        if record and runner is not None:
            runner.events.append(Event(pp_rank, "wait", "p2p", start - origin, end - origin))

    transport = Transport(
        pp_group if distributed else None,
        torch.device(device),
        on_wait,
        None if timeout is None else timedelta(seconds=timeout),
        channels=channels if distributed and p > 1 else None,
    )
    if distributed and p > 1 and tensor_shapes is None:
        transport.prepare()
    hooks = hooks or PipelineHooks()
    shapes = ActivationShapes(transport, pp_rank, tensor_shapes)
    compute_class, extra = _compute_for(sched, weight_stash)
    compute = compute_class(
        schedule=sched,
        pp_rank=pp_rank,
        forward_step_func=forward_step_func,
        iterators=iterators,
        chunks=chunks,
        shapes=shapes,
        hooks=hooks,
        **extra,
    )
    runner = StageRunner(
        pp_rank=pp_rank,
        transport=transport,
        shapes=shapes,
        compute=compute,
        clock=clock,
        record=record,
    )
    plan, delivered = _plan(sched)
    runner.run(plan[pp_rank], delivered[pp_rank])
    if not forward_only and hooks.post_backward is not None:
        hooks.post_backward()

    # Every rank reports the loss: the last stage's mean, summed over the pipeline group.
    holds_loss = pp_rank == sched.rank_of(sched.num_virtual_stages - 1)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    if holds_loss:
        loss += torch.stack(compute.losses).float().mean()
    if distributed and p > 1:
        comm.all_reduce(loss, pp_group)
    return PipelineResult(
        loss=loss,
        microbatch_losses=compute.losses,
        peak_in_flight=compute.peak,
        weight_versions=compute.weight_versions,
        weight_copies=compute.weight_copies,
        events=runner.events if record else [],
        schedule=sched,
    )


def _compute_for(
    schedule: Schedule, weight_stash: WeightStash | None
) -> tuple[type[StageCompute], dict]:
    """The compute a schedule's actions need, decided once from its traits: whole
    backwards; split ones (``I``, ``W``); or the weight versions and optimizer steps of an
    asynchronous schedule."""
    if schedule.asynchronous:
        return StashingCompute, {"stash": weight_stash}
    if schedule.splits_backward:
        return SplitBackwardCompute, {}
    return StageCompute, {}


def mark_chunk_stage(
    chunk: nn.Module, stage: int, placement: Sequence[Sequence[int]] | None
) -> None:
    """Record that ``chunk`` runs virtual ``stage`` of a pipeline laid out as
    ``placement`` (None: only the stage is known)."""
    chunk.pipeline_stage = stage
    chunk.pipeline_placement = None if placement is None else _as_tuples(placement)


def _as_tuples(placement: Sequence[Sequence[int]]) -> Placement:
    return tuple(tuple(row) for row in placement)


def chunk_stage(chunk: nn.Module) -> tuple[int | None, Placement | None]:
    """``(stage, placement)`` recorded on ``chunk`` or on the module it wraps (a
    data-parallel wrapper's ``module``); ``(None, None)`` for an unmarked chunk."""
    module: nn.Module | None = chunk
    while module is not None:
        if hasattr(module, "pipeline_stage"):
            return module.pipeline_stage, module.pipeline_placement
        inner = getattr(module, "module", None)
        module = inner if isinstance(inner, nn.Module) else None
    return None, None


def check_chunk_stages(schedule: Schedule, pp_rank: int, chunks: Sequence[nn.Module]) -> None:
    """Raise ``ValueError`` unless every marked chunk of ``pp_rank`` was built for the
    virtual stage ``schedule`` places there, and for ``schedule``'s placement."""
    for index, chunk in enumerate(chunks):
        stage, placement = chunk_stage(chunk)
        want = schedule.virtual_stage(pp_rank, index)
        if stage is not None and stage != want:
            raise ValueError(
                f"model chunk {index} of pipeline rank {pp_rank} was built for virtual stage "
                f"{stage}, but {schedule.name} runs virtual stage {want} there; build the "
                "chunks for the schedule (build_gpt_chunks(..., schedule=...))"
            )
        if placement is not None and placement != _as_tuples(schedule.placement):
            raise ValueError(
                f"the model chunks were built for the placement {placement} "
                f"(placement[rank][chunk] is a virtual stage), but {schedule.name} places "
                f"them as {schedule.placement}; build the chunks for the schedule "
                "(build_gpt_chunks(..., schedule=...))"
            )


def get_forward_backward_func(schedule: str | None = None) -> Callable[..., PipelineResult]:
    """Megatron-style accessor for scripts: :func:`forward_backward` bound to the current
    layout's pipeline group and schedule (the default for its chunks per rank)."""
    from megapp import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    if schedule is None:
        schedule = default_schedule(ps.get_virtual_pipeline_model_parallel_world_size() or 1)
    return functools.partial(forward_backward, schedule=schedule, pp_group=pp_group)
