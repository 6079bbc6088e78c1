"""The planner: every layout of a model on N devices, checked, fitted in memory and timed.

``python -m megapp.plan --model gpt3-175b --gpus 1024 --gpus-per-node 8 --gpu h100
--global-batch-size 1536 --seq-length 2048 --top-k 5`` prints the fastest layouts that fit
(memory per device, iteration time, throughput, MFU, bubble) and the ``torchrun`` line
of each. Arithmetic alone shapes the space (:func:`~megapp.planning.layout_space.layouts`);
``pretrain_config`` decides validity as ``pretrain_gpt.py`` would, ``predict_memory`` the
fit. Layouts are visited in order of a lower bound on their time
(:meth:`~megapp.planning.timing.ActionCosts.lower_bound`, shared by the schedules of one
placement, no simulation) until the next bound is no better than the k-th best simulated
time; docs/planning.md describes the search.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.catalog import SCHEDULES, V_SHAPED, build_schedule, default_schedule
from megapp.pipeline_parallel.messages import ScheduleError
from megapp.pipeline_parallel.partition import split_layers
from megapp.pipeline_parallel.schedules import Schedule, looped_placement, v_placement
from megapp.pipeline_parallel.simulate import simulate
from megapp.planning import step_time, timing
from megapp.planning.hardware import Hardware, load_hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.layout_space import Space, layouts, why_empty
from megapp.planning.model_state import chunk_parameters, model_state
from megapp.planning.models import BYTE_VOCAB, ModelPreset, load_model
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.parallel_flags import ParallelArgs

_GIB = 2**30
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-h2", "zb-v", "dualpipev"})
"""Schedules that split every backward into I and W (the zero-bubble builders')."""
_BUCKET = ParallelArgs().ddp_bucket_size
_COUNTED = {
    "slower": "timed",
    "invalid": "invalid",
    "memory": "over_memory",
    "deadlock": "deadlocks",
}


@dataclass(frozen=True)
class Planned:
    """One layout that fits, with its predictions."""

    layout: Layout
    memory_bytes: float  # the largest prediction over the pipeline ranks
    step: step_time.StepTime


@dataclass
class PlanResult:
    """The best layouts, fastest first, and what the search did with the rest."""

    best: list[Planned]
    enumerated: int = 0  # layouts the arithmetic allows
    over_memory: int = 0  # dropped: model state, or the predicted total, exceeds memory
    invalid: int = 0  # refused by pretrain_gpt.py's checks
    deadlocks: int = 0  # the schedule cannot complete on the hardware's transport
    timed: int = 0  # simulated
    seconds: float = 0.0


class Planner:
    """Plans one model on one machine; caches what many layouts share."""

    def __init__(
        self, model: ModelPreset, hardware: Hardware, global_batch_size: int, gpus: int
    ) -> None:
        self.model, self.hardware, self.gbs, self.gpus = model, hardware, global_batch_size, gpus
        self.base = pretrain_config(Layout(), model.flags, 1).gpt_config(model.vocab_size)
        self._costs: dict[tuple, timing.ActionCosts | None] = {}
        self._gpts: dict[tuple, GPTConfig | None] = {}
        self._states: dict[tuple, bool] = {}
        self._bounds: dict[tuple, float] = {}
        self._schedules: dict[tuple, Schedule | str] = {}

    def gpt(self, layout: Layout) -> GPTConfig | None:
        """The model under ``layout`` as ``pretrain_gpt.py`` builds it (None where the
        model's own rules refuse the tensor-parallel size)."""
        key = (layout.tp, layout.sequence_parallel, layout.recompute)
        if key not in self._gpts:
            full = layout.recompute == "full"
            try:
                self._gpts[key] = dataclasses.replace(
                    self.base,
                    tensor_model_parallel_size=layout.tp,
                    sequence_parallel=layout.sequence_parallel,
                    recompute_granularity=layout.recompute,
                    recompute_method="uniform" if full else None,
                    recompute_num_layers=1 if full else None,
                )
            except ValueError:
                self._gpts[key] = None
        return self._gpts[key]

    def state_fits(self, layout: Layout, gpt: GPTConfig, placement) -> bool:
        """Whether every rank's model state alone fits in memory (a bound on the total)."""
        key = (layout.tp, layout.dp, layout.zero_stage, placement)
        if key not in self._states:
            stages = layout.pp * layout.vpp
            ranges = split_layers(gpt.num_layers, stages)
            per_stage = [chunk_parameters(gpt, s, stages, len(ranges[s])) for s in range(stages)]
            params = max(sum(per_stage[s] for s in row) for row in placement)
            state = model_state(params, gpt.params_dtype, layout.dp, layout.zero_stage)
            self._states[key] = state.total <= self.hardware.usable_memory
        return self._states[key]

    @staticmethod
    def _key(layout: Layout) -> tuple:
        """What a layout's action costs depend on: all but the schedule, save its shape."""
        return (
            *(layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch_size),
            *(layout.sequence_parallel, layout.recompute, layout.zero_stage),
            layout.schedule in V_SHAPED,
        )

    def costs(self, layout: Layout) -> timing.ActionCosts | None:
        """Action costs of ``layout`` (None when its model state alone overflows memory),
        shared by every schedule with the same placement."""
        key = self._key(layout)
        v_shaped = key[-1]
        if key in self._costs:
            return self._costs[key]
        gpt = self.gpt(layout)
        placement = v_placement(layout.pp) if v_shaped else looped_placement(layout.pp, layout.vpp)
        costs = None
        if gpt is not None and self.state_fits(layout, gpt, placement):
            mbs, dp, seq = layout.micro_batch_size, layout.dp, self.model.seq_length
            shape = timing.Shape(seq, mbs, placement, dp, layout.zero_stage, _BUCKET)
            costs = timing.action_costs(gpt, shape, self.hardware)
            m = self.gbs // (mbs * dp)
            for split in (False, True):
                bound = costs.lower_bound(m, self.hardware.step_overhead, split)
                self._bounds[(*key, split)] = bound
        self._costs[key] = costs
        return costs

    def bound(self, layout: Layout) -> float | None:
        """The lower bound on ``layout``'s time; None when it overflows memory."""
        if self.costs(layout) is None:
            return None
        return self._bounds[(*self._key(layout), layout.schedule in SPLIT_BACKWARD)]

    def schedule(self, layout: Layout, num_microbatches: int) -> Schedule | str:
        """The schedule ``layout`` runs (built once per name and sizes), or "invalid"."""
        key = (layout.schedule, layout.pp, num_microbatches, layout.vpp)
        if key not in self._schedules:
            name = layout.schedule or default_schedule(layout.vpp)
            try:
                self._schedules[key] = build_schedule(name, *key[1:])
            except ValueError:
                self._schedules[key] = "invalid"
        return self._schedules[key]

    def evaluate(
        self, layout: Layout, costs: timing.ActionCosts, cutoff: float = math.inf
    ) -> Planned | str:
        """The prediction for ``layout``, or why it is dropped: "invalid" (refused by
        ``pretrain_gpt.py``'s checks), "deadlock" (the schedule cannot complete on this
        transport), "slower" (not under ``cutoff`` seconds), "memory" (does not fit).
        Simulates first: only a layout fast enough is checked and its memory predicted."""
        from megapp.planning.memory import predict_memory

        m = self.gbs // (layout.micro_batch_size * layout.dp)
        schedule = self.schedule(layout, m)
        if isinstance(schedule, str):
            return schedule
        try:
            timeline = simulate(schedule, timing.cost_model(costs, self.hardware))
        except ScheduleError:  # a property of the schedule alone: remember it
            self._schedules[(layout.schedule, layout.pp, m, layout.vpp)] = "deadlock"
            return "deadlock"
        config = None
        if self.hardware.shared_cores is not None:  # the slowdown needs the whole config
            config = self._config(layout)
            if config is None:
                return "invalid"
            costs, timeline = timing.share_cores(config, costs, timeline, self.hardware)
        if max(step_time.rank_finish(costs, timeline)) + self.hardware.step_overhead >= cutoff:
            return "slower"
        config = config or self._config(layout)
        if config is None:
            return "invalid"
        memory = max(r.total for r in predict_memory(config, self.model.vocab_size))
        if memory > self.hardware.usable_memory:
            return "memory"
        gpt = config.gpt_config(self.model.vocab_size)
        step = step_time.step_time(config, gpt, costs, timeline, self.hardware)
        return Planned(layout, memory, step)

    def _config(self, layout: Layout) -> PretrainConfig | None:
        try:
            return pretrain_config(layout, self.model.flags, self.gbs)
        except (ArgumentsError, ValueError):
            return None

    def plan(self, gpus_per_node: int, top_k: int, space: Space | None = None) -> PlanResult:
        """The ``top_k`` fastest layouts that fit, fastest first (in ``space``, default
        :class:`Space`'s limits)."""
        space = space or Space()
        start = time.perf_counter()
        result = PlanResult(best=[])
        bounded: list[tuple[float, int, Layout]] = []
        found = layouts(self.base, self.gpus, gpus_per_node, self.gbs, space)
        for layout in found:
            result.enumerated += 1
            bound = self.bound(layout)
            if bound is None:
                result.over_memory += 1
                continue
            bounded.append((bound, len(bounded), layout))
        bounded.sort(key=lambda item: (item[0], item[1]))
        for bound, _, layout in bounded:
            if len(result.best) >= top_k and bound >= result.best[top_k - 1].step.seconds:
                break
            cutoff = result.best[-1].step.seconds if len(result.best) >= top_k else math.inf
            outcome = self.evaluate(layout, self.costs(layout), cutoff)
            if isinstance(outcome, str):
                counter = _COUNTED[outcome]
                setattr(result, counter, getattr(result, counter) + 1)
            else:
                result.timed += 1
                result.best.append(outcome)
                result.best.sort(key=lambda planned: planned.step.seconds)
                del result.best[top_k:]
        result.seconds = time.perf_counter() - start
        return result


RUN_FLAGS = ("--lr", "1e-4", "--train-iters", "1000")
"""What ``pretrain_gpt.py`` needs besides the model and the layout; ``--run-flags`` replaces
it (data and tokenizer flags belong there)."""


def command_line(
    layout: Layout,
    model: ModelPreset,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    run_flags: Sequence[str] = RUN_FLAGS,
) -> str:
    """The ``torchrun`` line that trains ``model`` under ``layout``; a model on megapp's
    byte tokens trains on the built-in corpus."""
    per_node = min(gpus, gpus_per_node)
    launch = ["torchrun", "--nproc-per-node", str(per_node)]
    if gpus > per_node:
        launch += ["--nnodes", str(gpus // per_node)]
    flags = [*model.flags, *layout.flags(model.num_layers)]
    flags += ["--global-batch-size", str(global_batch_size), *run_flags]
    if model.vocab_size == BYTE_VOCAB and not any(f.startswith("--data-path") for f in run_flags):
        flags.append("--use-default-corpus")
    return shlex.join([*launch, "pretrain_gpt.py", *flags])


def format_table(
    result: PlanResult,
    model: ModelPreset,
    gpus: int,
    gpus_per_node: int,
    global_batch_size: int,
    run_flags: Sequence[str] = RUN_FLAGS,
) -> str:
    """The top-k table, a command line under each row."""
    head = (
        f"{'#':>2}  {'layout':<48} {'mem GiB':>8} {'step s':>9} {'tok/s/GPU':>10} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'bubble':>7}"
    )
    lines = [head]
    for i, planned in enumerate(result.best, 1):
        step = planned.step
        mfu = "-" if step.mfu is None else f"{100 * step.mfu:.1f}%"
        lines.append(
            f"{i:>2}  {planned.layout.name:<48} {planned.memory_bytes / _GIB:>8.1f} "
            f"{step.seconds:>9.4g} {step.tokens_per_second_per_gpu:>10.1f} "
            f"{step.tflops_per_gpu:>8.4g} {mfu:>6} {100 * step.bubble:>6.1f}%"
        )
        cmd = command_line(planned.layout, model, gpus, gpus_per_node, global_batch_size, run_flags)
        lines.append(f"    {cmd}")
    return "\n".join(lines)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m megapp.plan", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="a preset (megapp.planning.models) or a flags file")
    add("--vocab-size", type=_positive, help="tokenizer vocabulary (flag files)")
    add("--gpus", type=_positive, required=True, help="devices in the job")
    add("--gpus-per-node", type=_positive, help="default: the hardware's")
    add("--gpu", default="h100", help="h100, h200, a100 or a JSON profile")
    add("--global-batch-size", type=_positive, required=True)
    add("--seq-length", type=_positive, help="default: the model's")
    add("--top-k", type=_positive, default=5)
    add("--max-micro-batch-size", type=_positive, default=8)
    add("--max-chunks", type=_positive, default=8, help="virtual stages per rank")
    add("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    add("--run-flags", default=shlex.join(RUN_FLAGS), help="appended to every command (data)")
    add("--calibrate", action="store_true", help="measure this machine (--gpus processes)")
    add("--hardware-out", default="runs/calibration/hardware.json", help="--calibrate's file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model = load_model(args.model, args.vocab_size)
        if args.seq_length is not None:
            model = model.with_seq_length(args.seq_length)
        if args.calibrate:
            from megapp.planning.calibrate import calibrate

            hardware = calibrate(args.gpus, args.hardware_out)
        else:
            hardware = load_hardware(args.gpu)
        gpn = args.gpus_per_node or hardware.gpus_per_node
        if args.gpus > gpn and args.gpus % gpn:
            raise ValueError(f"--gpus {args.gpus} is not a whole number of {gpn}-GPU nodes")
        hardware = hardware.with_gpus_per_node(gpn)
        planner = Planner(model, hardware, args.global_batch_size, args.gpus)
        space = Space(args.max_micro_batch_size, args.max_chunks, tuple(args.schedules))
        result = planner.plan(gpn, args.top_k, space)
    except (ArgumentsError, ValueError) as error:
        print(f"python -m megapp.plan: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(
        f"{args.model} on {args.gpus} × {hardware.name} ({gpn} per node), global batch "
        f"{args.global_batch_size}, sequence {model.seq_length}: {result.enumerated} layouts, "
        f"{result.over_memory} over {hardware.usable_memory / _GIB:.1f} GiB, "
        f"{result.invalid} refused, {result.deadlocks} deadlock on this transport, "
        f"{result.timed} simulated in {result.seconds:.1f} s"
    )
    if not result.enumerated:  # the arithmetic left nothing to check or fit
        why = why_empty(planner.base, args.gpus, gpn, args.global_batch_size, space)
        print(f"python -m megapp.plan: error: no layout: {why}", file=sys.stderr)
        return 2
    if not result.best:
        why = "no layout fits in memory"
        if result.invalid or result.deadlocks:
            why = (
                f"no layout can run: {result.over_memory} over memory, {result.invalid} "
                f"refused by pretrain_gpt.py's checks, {result.deadlocks} deadlock on this "
                "transport"
            )
        print(f"python -m megapp.plan: error: {why}", file=sys.stderr)
        return 1
    run_flags = shlex.split(args.run_flags)
    print(format_table(result, model, args.gpus, gpn, args.global_batch_size, run_flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
