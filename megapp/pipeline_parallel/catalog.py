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
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches, num_chunks)
