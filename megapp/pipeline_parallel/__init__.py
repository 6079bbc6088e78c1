"""Pipeline parallelism: schedules as data, their simulator, and the engine that runs them."""

from megapp.pipeline_parallel.asynchronous import (
    held_versions,
    pipedream,
    pipedream_2bw,
    stash_profile,
)
from megapp.pipeline_parallel.catalog import (
    ASYNC_SCHEDULES,
    SCHEDULE_KINDS,
    SCHEDULES,
    ScheduleKind,
    build_schedule,
    default_schedule,
    schedule_kind,
    schedule_placement,
)
from megapp.pipeline_parallel.engine import (
    PipelineHooks,
    PipelineResult,
    forward_backward,
    get_forward_backward_func,
)
from megapp.pipeline_parallel.messages import ScheduleError, communication_plan
from megapp.pipeline_parallel.p2p import TensorSpec
from megapp.pipeline_parallel.schedules import (
    Action,
    Op,
    Schedule,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
)
from megapp.pipeline_parallel.simulate import CostModel, Timeline, simulate
from megapp.pipeline_parallel.weight_stash import WeightStash
from megapp.pipeline_parallel.zero_bubble import dualpipev, zb_h1, zb_v
from megapp.pipeline_parallel.zero_bubble_greedy import zb_h2

__all__ = [
    "ASYNC_SCHEDULES",
    "SCHEDULES",
    "SCHEDULE_KINDS",
    "Action",
    "CostModel",
    "Op",
    "PipelineHooks",
    "PipelineResult",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "TensorSpec",
    "Timeline",
    "WeightStash",
    "build_schedule",
    "communication_plan",
    "default_schedule",
    "dualpipev",
    "forward_backward",
    "get_forward_backward_func",
    "gpipe",
    "held_versions",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "pipedream",
    "pipedream_2bw",
    "schedule_kind",
    "schedule_placement",
    "simulate",
    "stash_profile",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
