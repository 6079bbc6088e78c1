"""Every schedule megapp builds, by name."""

from __future__ import annotations

from collections.abc import Callable

from megapp.pipeline_parallel.schedules import (
    Schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
)
from megapp.pipeline_parallel.zero_bubble import dualpipev, zb_h1, zb_h2, zb_v

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
"""Builders ``(p, m, v) -> Schedule``."""

V_SHAPED = frozenset({"zb-v", "dualpipev"})
"""Schedules that place two chunks per rank in a V (first and last stage on rank 0)."""


def build_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_chunks: int = 1,
    *,
    group_size: int | None = None,
) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`SCHEDULES`). ``group_size``:
    interleaved 1F1B's microbatches per group (Megatron's
    ``microbatch_group_size_per_vp_stage``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if group_size is not None:
        if name != "interleaved-1f1b":
            raise ValueError(f"a microbatch group size applies to interleaved-1f1b, not {name}")
        return interleaved_1f1b(num_stages, num_microbatches, num_chunks, group_size)
    return SCHEDULES[name](num_stages, num_microbatches, num_chunks)


def default_schedule(num_chunks: int) -> str:
    """Megatron's choice: 1F1B, interleaved with several chunks per rank."""
    return "interleaved-1f1b" if num_chunks > 1 else "1f1b"
