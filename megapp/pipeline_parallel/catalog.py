"""Every schedule megapp builds, by name."""

from __future__ import annotations

from collections.abc import Callable

from megapp.pipeline_parallel.asynchronous import pipedream, pipedream_2bw
from megapp.pipeline_parallel.schedules import (
    Schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    looped_placement,
    one_f_one_b,
    v_placement,
)
from megapp.pipeline_parallel.zero_bubble import check_v_chunks, dualpipev, zb_h1, zb_h2, zb_v

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "looped-bfs": looped_bfs,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "dualpipev": dualpipev,
}
"""Builders ``(p, m, v) -> Schedule`` of the flushed schedules: one iteration each, the
optimizer steps after it."""

ASYNC_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "pipedream": pipedream,
    "pipedream-2bw": pipedream_2bw,
}
"""Builders ``(p, m, v, iterations=...) -> Schedule`` of the schedules that step among
their actions and never flush (:mod:`~megapp.pipeline_parallel.asynchronous`): a
different training rule, so never picked for a flushed one."""

V_SHAPED = frozenset({"zb-v", "dualpipev"})
"""Schedules that place two chunks per rank in a V (first and last stage on rank 0)."""


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
    """Build the schedule called ``name`` (one of :data:`SCHEDULES` or
    :data:`ASYNC_SCHEDULES`). ``group_size``: interleaved 1F1B's microbatches per group
    (Megatron's ``microbatch_group_size_per_vp_stage``). ``iterations``: how many
    iterations of ``num_microbatches`` an asynchronous schedule runs without a flush;
    ``vertical_sync``: PipeDream's, every stage on the first stage's weights version."""
    if name in ASYNC_SCHEDULES:
        if group_size is not None:
            raise ValueError(f"a microbatch group size applies to interleaved-1f1b, not {name}")
        if vertical_sync and name != "pipedream":
            raise ValueError(f"vertical sync applies to pipedream, not {name}")
        extra = {"vertical_sync": True} if vertical_sync else {}
        return ASYNC_SCHEDULES[name](
            num_stages, num_microbatches, num_chunks, iterations=iterations, **extra
        )
    _check_known(name)
    if iterations != 1 or vertical_sync:
        raise ValueError(
            f"{name} flushes after every iteration; iterations and vertical sync apply to "
            f"{' and '.join(ASYNC_SCHEDULES)}"
        )
    if group_size is not None:
        if name != "interleaved-1f1b":
            raise ValueError(f"a microbatch group size applies to interleaved-1f1b, not {name}")
        return interleaved_1f1b(num_stages, num_microbatches, num_chunks, group_size)
    return SCHEDULES[name](num_stages, num_microbatches, num_chunks)


def _check_known(name: str) -> None:
    if name not in SCHEDULES and name not in ASYNC_SCHEDULES:
        known = ", ".join([*SCHEDULES, *ASYNC_SCHEDULES])
        raise ValueError(f"unknown schedule {name!r}; choose one of {known}")


def schedule_placement(
    name: str, num_stages: int, num_chunks: int = 1
) -> tuple[tuple[int, ...], ...]:
    """``placement[rank][chunk]``: the virtual stage each chunk runs under the schedule
    called ``name``, as its builder places it; known before the number of microbatches
    is, so the model can be built for it."""
    _check_known(name)
    if name in V_SHAPED:
        check_v_chunks(name, num_chunks)
        return v_placement(num_stages)
    return looped_placement(num_stages, num_chunks)


def default_schedule(num_chunks: int) -> str:
    """Megatron's choice: 1F1B, interleaved with several chunks per rank."""
    return "interleaved-1f1b" if num_chunks > 1 else "1f1b"


def asynchronous_run(schedule: Schedule, iterations: int) -> Schedule:
    """``schedule`` (PipeDream or 2BW, over any number of iterations) over ``iterations``
    iterations of the same microbatches each, without a flush."""
    if not schedule.asynchronous:
        raise ValueError(f"{schedule.name} flushes after every iteration")
    vertical_sync = schedule.name == "pipedream-vsync"
    return build_schedule(
        "pipedream" if vertical_sync else schedule.name,
        schedule.num_stages,
        schedule.num_microbatches // schedule.iterations,
        schedule.num_chunks,
        iterations=iterations,
        vertical_sync=vertical_sync,
    )
