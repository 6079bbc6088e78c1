"""Pipeline parallelism: schedules as data, their simulator, and the engine that runs them."""

from megapp.pipeline_parallel.engine import (
    PipelineHooks,
    PipelineResult,
    forward_backward,
    get_forward_backward_func,
)
from megapp.pipeline_parallel.p2p import TensorSpec
from megapp.pipeline_parallel.plan import ScheduleError, communication_plan
from megapp.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from megapp.pipeline_parallel.simulate import CostModel, Timeline, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "CostModel",
    "Op",
    "PipelineHooks",
    "PipelineResult",
    "Schedule",
    "ScheduleError",
    "TensorSpec",
    "Timeline",
    "build_schedule",
    "communication_plan",
    "forward_backward",
    "get_forward_backward_func",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "simulate",
]
