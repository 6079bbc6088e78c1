"""Why a layout takes the time and memory it does: its predicted iteration split into the
terms the time model prices, and its memory into the terms the memory model counts.

The step is the time of the pipeline rank that finishes last (the predicted step is its
finish plus the step overhead), split into what that rank does (:class:`StepBreakdown`):

- its actions' seconds, each split by the time model itself (:mod:`megapp.planning.timing`)
  priced again without the term in question: **data-parallel in the actions** is what
  ZeRO-2/3's gathers and reduce-scatters add to the actions beyond the compute they overlap
  (the actions at ZeRO 0 subtracted); **recompute** is what the rerun forward adds (the
  actions without recompute subtracted: its FLOPs, its layer passes and its collectives);
  then, of the actions without either, the **tensor-parallel** collectives and the
  **context-parallel** transfers (both on the critical path: timing.py overlaps neither with
  compute, except the ring's exposed part; under ``--tp-comm-overlap`` the tensor-parallel
  line is what the overlap leaves exposed plus its matmuls' loss to pieces and to
  held-back multiprocessors), the **expert all-to-alls**, and **compute**
  (GEMMs at the device's rate, per-action overheads, the loss's memory passes);
- its idle time before its last action: the **pipeline bubble** (the same schedule simulated
  with free pipeline messages) and the **pipeline messages** (what their latency and bytes
  add to the waits);
- its work after the last action: the **data-parallel** gradient reduction's exposed part
  (the rest runs under the last microbatch's backward) and ZeRO-1/2's all-gather of the
  updated weights, the **tied embedding**'s sum over the first and last stage, the
  **optimizer** step; then the **step overhead**.

Asynchronous schedules (PipeDream, 2BW) step among their actions: their steps' terms count
once per iteration, everything per iteration of the simulated run. A time model whose
actions run slower than priced (processes sharing CPU cores) shows the difference as its
own line; the lines always add up to the predicted step.

Memory is :func:`~megapp.planning.memory.predict_memory`'s per pipeline rank
(:class:`MemoryBreakdown`), worst rank first; :func:`explanation_rows` gives both as rows
(for tables and ablation reports); :mod:`megapp.planning.explain_text` writes them as text.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig, placement_layer_ranges
from megapp.pipeline_parallel.schedules import Op
from megapp.pipeline_parallel.simulate import Timeline
from megapp.planning.layer_costs import moe_layer_seconds
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.memory import RankMemory, predict_memory
from megapp.planning.model_state import moe_layer_count
from megapp.planning.step_time import StepTime
from megapp.planning.timing import (
    ActionCosts,
    Shape,
    TimeModel,
    shape_of,
    simulate_step,
)
from megapp.training.config import PretrainConfig

STEP_LINES: dict[str, str] = {
    "compute": "compute (GEMMs, per-action overheads, loss passes)",
    "recompute": "recompute (the rerun forward, its collectives too)",
    "tensor_parallel": "tensor-parallel collectives",
    "context_parallel": "context-parallel transfers (exposed)",
    "expert_all_to_all": "expert all-to-alls",
    "data_parallel_actions": "data-parallel in the actions (ZeRO-2/3, exposed)",
    "bubble": "pipeline bubble (waiting for other stages)",
    "pipeline_messages": "pipeline messages (waits they add)",
    "data_parallel_tail": "data-parallel after the last action (exposed)",
    "embedding_sum": "tied embedding's sum (first and last stage)",
    "optimizer": "optimizer step",
    "unpriced": "slower than the priced parts (processes sharing cores)",
    "step_overhead": "step overhead",
}
"""The lines of a :class:`StepBreakdown` that add up to the predicted step, in order."""

MEMORY_LINES: dict[str, str] = {
    "weights": "weights",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "stashed": "stashed weights",
    "activations": "activations",
    "working": "working buffers",
}
"""The lines of a :class:`MemoryBreakdown` that add up to its total, in order."""


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per iteration of the pipeline rank that finishes last, one field per
    :data:`STEP_LINES` entry (they add up to ``seconds``), and context for them."""

    seconds: float  # the predicted step (StepTime.seconds)
    rank: int  # the pipeline rank that finishes last
    compute: float
    recompute: float
    tensor_parallel: float
    context_parallel: float
    expert_all_to_all: float
    data_parallel_actions: float
    bubble: float
    pipeline_messages: float
    data_parallel_tail: float
    embedding_sum: float
    optimizer: float
    unpriced: float
    step_overhead: float
    bubble_fraction: float  # idle share of all ranks' time (StepTime.bubble)
    grad_reduce: float  # the rank's whole gradient reduction, before overlap
    p2p_message: float  # one pipeline message

    def lines(self) -> list[tuple[str, float]]:
        """``(name, seconds)`` of every :data:`STEP_LINES` entry, in order."""
        return [(name, getattr(self, name)) for name in STEP_LINES]

    @property
    def residual(self) -> float:
        """The predicted step less the lines: float round-off only."""
        return self.seconds - sum(value for _, value in self.lines())


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes of one pipeline rank at its peak, one field per
    :data:`MEMORY_LINES` entry (they add up to ``total``)."""

    pp_rank: int
    weights: float
    grads: float
    optimizer: float
    stashed: float
    activations: float  # held for backward at the peak
    in_flight: float  # microbatch-chunks those activations belong to
    working: float
    total: float

    @classmethod
    def of(cls, memory: RankMemory) -> MemoryBreakdown:
        return cls(
            memory.pp_rank,
            memory.weights,
            memory.grads,
            memory.optimizer,
            memory.stashed,
            memory.activations,
            memory.in_flight,
            memory.working,
            memory.total,
        )

    @property
    def per_microbatch(self) -> float:
        """Mean activation bytes of one microbatch-chunk in flight at the peak (0 with
        none)."""
        return self.activations / self.in_flight if self.in_flight else 0.0

    def lines(self) -> list[tuple[str, float]]:
        """``(name, bytes)`` of every :data:`MEMORY_LINES` entry, in order."""
        return [(name, getattr(self, name)) for name in MEMORY_LINES]


@dataclass(frozen=True)
class Explanation:
    """A layout's prediction and why: the step and every pipeline rank's memory, worst
    first."""

    name: str
    step_time: StepTime
    step: StepBreakdown
    memory: list[MemoryBreakdown]
    usable_memory: float

    @property
    def peak(self) -> MemoryBreakdown:
        return self.memory[0]


_NAME = re.compile(
    r"tp(?P<tp>\d+)(?:\.cp(?P<cp>\d+)-(?P<cp_comm_type>[a-z0-9_]+))?(?:\.ep(?P<ep>\d+))?"
    r"(?:\.etp(?P<etp>\d+))?\.pp(?P<pp>\d+)\.dp(?P<dp>\d+)\.v(?P<vpp>\d+)(?:\+(?P<split>e?l?))?"
    r"\.mb(?P<micro_batch_size>\d+)\.(?P<schedule>[a-z0-9-]+)(?P<sp>\.sp)?(?P<tpo>\.tpo)?"
    r"\.(?P<recompute>norecompute|selective|full)\.z(?P<zero_stage>\d)"
)
LAYOUT_FORMAT = (
    "tp<n>[.cp<n>-<comm>][.ep<n>][.etp<n>].pp<n>.dp<n>.v<n>[+e|+l|+el].mb<n>.<schedule|default>"
    "[.sp[.tpo]]"
    ".<norecompute|selective|full>.z<n>"
)


def parse_layout(name: str) -> Layout:
    """The :class:`~megapp.planning.layout.Layout` whose :attr:`~Layout.name` is ``name``
    (as the planner's table prints it); ``ValueError`` in one line otherwise."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"layout {name!r} does not parse: expected {LAYOUT_FORMAT}")
    fields = {k: v for k, v in match.groupdict().items() if v is not None}
    for key in ("tp", "cp", "ep", "etp", "pp", "dp", "vpp", "micro_batch_size", "zero_stage"):
        if key in fields:
            fields[key] = int(fields[key])
    fields["sequence_parallel"] = "sp" in fields
    fields["tp_comm_overlap"] = "tpo" in fields
    fields.pop("sp", None)
    fields.pop("tpo", None)
    split = fields.pop("split", "")
    fields["embedding_in_split"], fields["loss_in_split"] = "e" in split, "l" in split
    fields["schedule"] = None if fields["schedule"] == "default" else fields["schedule"]
    fields["recompute"] = None if fields["recompute"] == "norecompute" else fields["recompute"]
    try:
        return Layout(**fields)
    except ValueError as error:
        raise ValueError(f"layout {name!r}: {error}") from None


def explain_layout(
    layout: Layout,
    model_flags: tuple[str, ...] | list[str],
    vocab_size: int,
    global_batch_size: int,
    gpus: int,
    model: TimeModel,
) -> Explanation:
    """:func:`explain` of ``layout`` for the model of ``model_flags`` on ``gpus`` devices;
    ``ValueError`` in one line where the layout does not use ``gpus`` devices or
    ``pretrain_gpt.py`` would refuse it (:class:`ScheduleError` where its schedule cannot
    complete on the transport)."""
    if layout.world_size != gpus:
        raise ValueError(
            f"layout {layout.name} runs on {layout.world_size} GPUs, not the {gpus} of --gpus"
        )
    try:
        config = pretrain_config(layout, model_flags, global_batch_size)
    except ValueError as error:  # ArgumentsError included
        raise ValueError(f"layout {layout.name} is not valid for this model: {error}") from None
    return explain(config, vocab_size, model, layout.name)


def explain(
    config: PretrainConfig,
    vocab_size: int,
    model: TimeModel,
    name: str = "",
    transport: str | None = None,
) -> Explanation:
    """The predicted step of ``config`` (as :func:`~megapp.planning.timing.predict`
    predicts it) and its memory, each broken down; the memory on devices that move tensors
    by ``transport`` (None: the time model's hardware's)."""
    run = simulate_step(config, vocab_size, model)
    free = dataclasses.replace(run.planned, p2p=0.0)  # the schedule's own bubble
    _, quiet = model.run(run.schedule, free, config.world_size)
    breakdown = step_breakdown(config, run.gpt, model, run.planned, run.costs, run.step, quiet)
    step = run.step
    memory = sorted(
        (
            MemoryBreakdown.of(m)
            for m in predict_memory(config, vocab_size, transport or model.hardware.transport)
        ),
        key=lambda m: (-m.total, m.pp_rank),
    )
    return Explanation(name, step, breakdown, memory, model.hardware.usable_memory)


_PARTS = ("compute", "recompute", "tensor_parallel", "context_parallel")
_PARTS += ("expert_all_to_all", "data_parallel_actions")


def action_parts(
    gpt: GPTConfig, shape: Shape, model: TimeModel, costs: ActionCosts
) -> dict[Op, list[list[dict[str, float]]]]:
    """Every action's seconds of one microbatch per ``[rank][chunk]`` (of ``costs``, the
    model's action costs of ``gpt`` under ``shape``) split into compute, recompute,
    tensor_parallel, context_parallel, expert_all_to_all and data_parallel_actions, which
    add up to it."""
    plain = costs
    if shape.zero_stage >= 2:
        plain = model.action_costs(gpt, dataclasses.replace(shape, zero_stage=0))
    bare_gpt = dataclasses.replace(
        gpt, recompute_granularity=None, recompute_method=None, recompute_num_layers=None
    )
    bare = plain
    if gpt.recompute_granularity is not None:
        bare = model.action_costs(bare_gpt, dataclasses.replace(shape, zero_stage=0))
    a2a = 0.0
    if gpt.num_moe_experts is not None:
        a2a = moe_layer_seconds(gpt, shape.seq_length, shape.micro_batch_size, model.hardware)[1]
    ranges = placement_layer_ranges(gpt, shape.placement)
    zeros = [[0.0] * len(row) for row in shape.placement]
    tables = {
        Op.FORWARD: ("forward", bare.tp_forward, bare.cp_forward or zeros, 1),
        Op.INPUT_GRAD: ("input_grad", bare.tp_backward, bare.cp_backward or zeros, 1),
        Op.BACKWARD: ("whole_backward", bare.tp_backward, bare.cp_backward or zeros, 1),
        Op.WEIGHT_GRAD: ("weight_grad", zeros, zeros, 0),
    }
    out: dict[Op, list[list[dict[str, float]]]] = {}
    for op, (field, tp, cp, exchanges) in tables.items():
        total, zero0, norecompute = (getattr(c, field) for c in (costs, plain, bare))
        rows = []
        for r, stages in enumerate(shape.placement):
            row = []
            for c, stage in enumerate(stages):
                ep = exchanges * moe_layer_count(gpt, len(ranges[stage])) * a2a
                comm = tp[r][c] + cp[r][c] + ep
                row.append(
                    {
                        "compute": norecompute[r][c] - comm,
                        "recompute": zero0[r][c] - norecompute[r][c],
                        "tensor_parallel": tp[r][c],
                        "context_parallel": cp[r][c],
                        "expert_all_to_all": ep,
                        "data_parallel_actions": total[r][c] - zero0[r][c],
                    }
                )
            rows.append(row)
        out[op] = rows
    return out


def step_breakdown(
    config: PretrainConfig,
    gpt: GPTConfig,
    model: TimeModel,
    planned: ActionCosts,
    costs: ActionCosts,
    step: StepTime,
    quiet: Timeline,
) -> StepBreakdown:
    """:class:`StepBreakdown` of ``step`` (of ``config`` under ``model``): ``planned`` are
    the model's action costs, ``costs`` and ``step.timeline`` what the run paid and did,
    ``quiet`` the timeline of the same run with free pipeline messages."""
    timeline, schedule = step.timeline, step.timeline.schedule
    iterations = schedule.iterations
    shape = shape_of(config)
    overhead = model.hardware.step_overhead
    ends = [0.0] * schedule.num_stages
    for event in timeline.events:
        ends[event.rank] = max(ends[event.rank], event.end)
    tails = [0.0 if schedule.asynchronous else t for t in costs.tail]
    rank = max(range(schedule.num_stages), key=lambda r: (ends[r] + tails[r], -r))
    parts = action_parts(gpt, shape, model, planned)
    sums = dict.fromkeys(_PARTS, 0.0)
    steps = 0  # optimizer steps among the actions (asynchronous schedules)
    for action in schedule.actions[rank]:
        if action.op is Op.UPDATE:
            steps += 1
            continue
        for name, value in parts[action.op][rank][action.chunk].items():
            sums[name] += value
    steps = steps if schedule.asynchronous else 1
    embedding = costs.embedding_sum[rank] if costs.embedding_sum else 0.0
    optimizer = costs.optimizer[rank]
    busy = timeline.busy(rank)
    priced = sum(sums.values()) + (steps * costs.tail[rank] if schedule.asynchronous else 0.0)
    idle = ends[rank] - busy
    quiet_idle = max(e.end for e in quiet.events if e.rank == rank) - quiet.busy(rank)
    per = 1.0 / iterations
    return StepBreakdown(
        seconds=step.seconds,
        rank=rank,
        **{name: value * per for name, value in sums.items()},
        bubble=quiet_idle * per,
        pipeline_messages=(idle - quiet_idle) * per,
        data_parallel_tail=steps * (costs.tail[rank] - optimizer - embedding) * per,
        embedding_sum=steps * embedding * per,
        optimizer=steps * optimizer * per,
        unpriced=(busy - priced) * per,
        step_overhead=overhead,
        bubble_fraction=step.bubble,
        grad_reduce=costs.grad_reduce[rank],
        p2p_message=costs.p2p,
    )


def explanation_rows(explanation: Explanation) -> list[tuple[str, float]]:
    """``(key, value)`` rows of ``explanation``: the headline numbers, every step line
    (``step.<name>``, seconds) and every memory line of the worst rank (``memory.<name>``,
    bytes; ``memory.in_flight`` in microbatch-chunks), for tables and reports."""
    step, peak = explanation.step_time, explanation.peak
    rows = [
        ("step_seconds", step.seconds),
        ("tokens_per_second_per_gpu", step.tokens_per_second_per_gpu),
        ("mfu", float("nan") if step.mfu is None else step.mfu),
        ("bubble_fraction", step.bubble),
    ]
    rows += [(f"step.{name}", value) for name, value in explanation.step.lines()]
    rows += [(f"memory.{name}", value) for name, value in peak.lines()]
    rows += [("memory.in_flight", peak.in_flight), ("memory.per_microbatch", peak.per_microbatch)]
    rows.append(("memory.total", peak.total))
    return rows


def comparison_rows(a: Explanation, b: Explanation) -> list[tuple[str, float, float, float]]:
    """``(key, a, b, b − a)`` for every row of :func:`explanation_rows`."""
    pairs = zip(explanation_rows(a), explanation_rows(b), strict=True)
    return [(key, x, y, y - x) for (key, x), (_, y) in pairs]
