"""Every schedule megapp builds, by name, and what is known of it before it is built.

A :class:`ScheduleKind` is one entry: its builder and its traits (how many model chunks
a rank runs, whether they sit in a V, whether backwards split into ``I`` and ``W``,
whether it steps among its actions, and for which layout it is Megatron's default).
Everything that asks a trait of a schedule by name asks it here, once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from megapp.pipeline_parallel.asynchronous import pipedream, pipedream_2bw
from megapp.pipeline_parallel.schedules import (
    Action,
    Schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    looped_placement,
    one_f_one_b,
    v_placement,
)
from megapp.pipeline_parallel.zero_bubble import dualpipev, zb_h1, zb_v
from megapp.pipeline_parallel.zero_bubble_greedy import zb_h2, zb_h2_opening


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule of the catalog.

    Attributes:
        name: what ``--pipeline-schedule`` and :func:`build_schedule` call it.
        build: ``(p, m, v) -> Schedule`` (an asynchronous one also takes ``iterations=``).
        min_chunks, max_chunks: model chunks per rank it runs (``max_chunks`` None: any
            number from ``min_chunks`` up).
        v_shaped: its two chunks per rank sit in a V, so the first and the last stage
            share rank 0 (otherwise chunk ``c`` of rank ``r`` is stage ``c·p + r``).
        split_backward: its backwards split into ``I`` and ``W``.
        asynchronous: it steps the optimizer among its actions and never flushes (a
            different training rule, so never picked for a flushed one).
        default_for: the chunks per rank for which it is Megatron's default: ``"one"``,
            ``"several"`` or None.
        grouped: it takes a microbatch group size (Megatron's
            ``microbatch_group_size_per_vp_stage``).
        vertical_sync: it can run every stage on the first stage's weights version.
        opening: ``(p, m, v) ->`` every rank's first actions, each a prefix of its list in
            ``build``'s schedule, for a fraction of its cost (None: nothing cheaper than
            the whole). What a rank holds over its prefix is at most what it holds over
            the whole, so a planner can refuse a layout on memory before building it.
    """

    name: str
    build: Callable[..., Schedule]
    min_chunks: int = 1
    max_chunks: int | None = None
    v_shaped: bool = False
    split_backward: bool = False
    asynchronous: bool = False
    default_for: str | None = None
    grouped: bool = False
    vertical_sync: bool = False
    opening: Callable[[int, int, int], tuple[tuple[Action, ...], ...]] | None = None

    @property
    def fixed_chunks(self) -> int | None:
        """The one chunk count per rank it runs, if it runs only one."""
        return self.min_chunks if self.max_chunks == self.min_chunks else None

    def chunks_text(self) -> str:
        """What it runs on a rank, in words: ``"runs one model chunk per rank"``."""
        if self.v_shaped:
            return "places two model chunks on every rank in a V"
        if self.fixed_chunks == 1:
            return "runs one model chunk per rank"
        if self.min_chunks > 1:
            return f"runs at least {self.min_chunks} model chunks per rank"
        return "runs any number of model chunks per rank"

    def runs_chunks(self, num_chunks: int) -> bool:
        """Whether it runs ``num_chunks`` model chunks per rank."""
        return self.min_chunks <= num_chunks and (
            self.max_chunks is None or num_chunks <= self.max_chunks
        )

    def check_chunks(self, num_chunks: int) -> None:
        """Raise ``ValueError`` saying what this schedule runs unless it runs
        ``num_chunks`` model chunks per rank."""
        if not self.runs_chunks(num_chunks):
            raise ValueError(
                f"{self.name} {self.chunks_text()}, not {num_chunks}"
                + (
                    f"; use {default_schedule(num_chunks)} for {num_chunks}"
                    if not self.asynchronous and not self.v_shaped
                    else ""
                )
            )

    def placement(self, num_stages: int, num_chunks: int) -> tuple[tuple[int, ...], ...]:
        """``placement[rank][chunk]``: the virtual stage each chunk runs."""
        self.check_chunks(num_chunks)
        return (
            v_placement(num_stages) if self.v_shaped else looped_placement(num_stages, num_chunks)
        )


_KINDS = (
    ScheduleKind("gpipe", gpipe, max_chunks=1),
    ScheduleKind("1f1b", one_f_one_b, max_chunks=1, default_for="one"),
    ScheduleKind(
        "interleaved-1f1b", interleaved_1f1b, min_chunks=2, default_for="several", grouped=True
    ),
    ScheduleKind("looped-bfs", looped_bfs),
    ScheduleKind("zb-h1", zb_h1, split_backward=True),
    ScheduleKind("zb-h2", zb_h2, split_backward=True, opening=zb_h2_opening),
    ScheduleKind("zb-v", zb_v, 2, 2, v_shaped=True, split_backward=True),
    ScheduleKind("dualpipev", dualpipev, 2, 2, v_shaped=True, split_backward=True),
    ScheduleKind("pipedream", pipedream, max_chunks=1, asynchronous=True, vertical_sync=True),
    ScheduleKind("pipedream-2bw", pipedream_2bw, max_chunks=1, asynchronous=True),
)

SCHEDULE_KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in _KINDS}
"""Every schedule megapp builds by name, flushed and asynchronous."""

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    kind.name: kind.build for kind in _KINDS if not kind.asynchronous
}
"""Builders ``(p, m, v) -> Schedule`` of the flushed schedules: one iteration each, the
optimizer steps after it."""

ASYNC_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    kind.name: kind.build for kind in _KINDS if kind.asynchronous
}
"""Builders ``(p, m, v, iterations=...) -> Schedule`` of the schedules that step among
their actions and never flush (:mod:`~megapp.pipeline_parallel.asynchronous`)."""


_BUILT_AS = {"pipedream-vsync": "pipedream"}  # names a builder gives what it built


def schedule_kind(name: str) -> ScheduleKind:
    """The catalog's entry called ``name`` (or whose builder names its schedules so, as
    PipeDream with vertical sync); ``ValueError`` naming the known ones otherwise."""
    kind = SCHEDULE_KINDS.get(_BUILT_AS.get(name, name))
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
    return kind


def default_schedule(num_chunks: int) -> str:
    """Megatron's choice for ``num_chunks`` model chunks per rank: the entry that is the
    default for one chunk (1F1B) or for several (interleaved 1F1B)."""
    wanted = "several" if num_chunks > 1 else "one"
    return next(kind.name for kind in _KINDS if kind.default_for == wanted)


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    *,
    group_size: int | None = None,
    iterations: int = 1,
    vertical_sync: bool = False,
) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`SCHEDULE_KINDS`). ``group_size``:
    interleaved 1F1B's microbatches per group (Megatron's
    ``microbatch_group_size_per_vp_stage``). ``iterations``: how many iterations of
    ``num_microbatches`` an asynchronous schedule runs without a flush;
    ``vertical_sync``: PipeDream's, every stage on the first stage's weights version.
    A schedule is immutable: the last few built are returned again for the same
    arguments (a planner and the config it checks ask for the same one in turn)."""
    return _build(name, num_stages, num_microbatches, num_chunks, group_size, iterations,
                  vertical_sync)  # fmt: skip


@functools.lru_cache(maxsize=32)
def _build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int,
    group_size: int | None,
    iterations: int,
    vertical_sync: bool,
) -> Schedule:
    kind = schedule_kind(name)
    if group_size is not None and not kind.grouped:
        grouped = ", ".join(k.name for k in _KINDS if k.grouped)
        raise ValueError(f"a microbatch group size applies to {grouped}, not {name}")
    if vertical_sync and not kind.vertical_sync:
        synced = ", ".join(k.name for k in _KINDS if k.vertical_sync)
        raise ValueError(f"vertical sync applies to {synced}, not {name}")
    if kind.asynchronous:
        extra = {"vertical_sync": True} if vertical_sync else {}
        return kind.build(num_stages, num_microbatches, num_chunks, iterations=iterations, **extra)
    if iterations != 1:
        unflushed = " and ".join(k.name for k in _KINDS if k.asynchronous)
        raise ValueError(f"{name} flushes after every iteration; iterations apply to {unflushed}")
    if group_size is not None:
        return kind.build(num_stages, num_microbatches, num_chunks, group_size)
    return kind.build(num_stages, num_microbatches, num_chunks)


def schedule_placement(
    name: str, num_stages: int, num_chunks: int = 1
) -> tuple[tuple[int, ...], ...]:
    """``placement[rank][chunk]``: the virtual stage each chunk runs under the schedule
    called ``name``, as its builder places it; known before the number of microbatches
    is, so the model can be built for it."""
    return schedule_kind(name).placement(num_stages, num_chunks)


def asynchronous_run(schedule: Schedule, iterations: int) -> Schedule:
    """``schedule`` (PipeDream or 2BW, over any number of iterations) over ``iterations``
    iterations of the same microbatches each, without a flush."""
    if not schedule.asynchronous:
        raise ValueError(f"{schedule.name} flushes after every iteration")
    name = _BUILT_AS.get(schedule.name, schedule.name)
    return build_schedule(
        name,
        schedule.num_stages,
        schedule.num_microbatches // schedule.iterations,
        schedule.num_chunks,
        iterations=iterations,
        vertical_sync=name != schedule.name,  # only vertical sync renames what it builds
    )
