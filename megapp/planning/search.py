"""The planner's search: every layout of a model on N devices, checked, fitted in memory and
timed, the fastest first.

Arithmetic alone shapes the space (:func:`~megapp.planning.layout_space.layouts`);
:func:`~megapp.planning.layout.pretrain_config` decides validity as ``pretrain_gpt.py``
would, :func:`~megapp.planning.memory.predict_memory` the fit. Layouts are visited in order
of a lower bound on their time (:meth:`~megapp.planning.timing.ActionCosts.lower_bounds`,
shared by the schedules of one placement, no simulation) until the next bound is no better
than the k-th best simulated time; docs/planning.md describes the search. The time comes
from a :class:`~megapp.planning.timing.TimeModel`: devices of their own for a
:class:`~megapp.planning.hardware.Hardware`, or any other model (a CPU machine's).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass

from megapp.models.gpt import GPTConfig, placement_layer_ranges
from megapp.pipeline_parallel.catalog import build_schedule, default_schedule, schedule_kind
from megapp.pipeline_parallel.messages import ScheduleError
from megapp.pipeline_parallel.partition import check_layer_split
from megapp.pipeline_parallel.schedules import Op, Schedule, looped_placement, v_placement
from megapp.pipeline_parallel.simulate import finish_times
from megapp.planning import step_time, timing
from megapp.planning.chunk_prices import chunk_prices
from megapp.planning.hardware import Hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.memory import (
    HeldWalk,
    chunk_activation_bytes,
    chunk_working_bytes,
    expert_data_parallel_size,
    held_walk,
    predict_memory,
    rank_state,
)
from megapp.planning.models import ModelPreset
from megapp.planning.profiles import time_model
from megapp.planning.weight_grad_store import weight_grad_store_bytes
from megapp.training.config import PretrainConfig
from megapp.training.flag_groups import ArgumentsError
from megapp.training.parallel_flags import ParallelArgs

_GIB = 2**30
_UNPRICED = object()  # a layout's costs not yet asked for (None: its state overflows)
_BUCKET = ParallelArgs().ddp_bucket_size
_COUNTED = {
    "slower": "timed",
    "bounded": "rescaled",
    "invalid": "invalid",
    "memory": "over_memory",
    "deadlock": "deadlocks",
}


def _kind(layout: Layout):
    """The catalog entry of the schedule ``layout`` runs (Megatron's default when unnamed)."""
    return schedule_kind(layout.schedule or default_schedule(layout.vpp))


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
    rescaled: int = 0  # slower by a bound from their schedule's simulation with other costs
    checked_first: int = 0  # checked and their memory predicted before any simulation
    seconds: float = 0.0


MODEL_FIELDS = ("tp", "sequence_parallel", "recompute", "cp", "cp_comm_type", "ep", "etp")
MODEL_FIELDS += ("embedding_in_split", "loss_in_split", "tp_comm_overlap")
"""The fields of a :class:`Layout` that reach the model ``pretrain_gpt.py`` builds."""
_model_key = operator.attrgetter(*MODEL_FIELDS)
# what a layout's action costs depend on besides its schedule's shape: all but the schedule
_costs_key = operator.attrgetter(
    *("tp", "pp", "dp", "vpp", "micro_batch_size", "sequence_parallel", "recompute"),
    *("zero_stage", "cp", "cp_comm_type", "ep", "etp", "embedding_in_split", "loss_in_split"),
    "tp_comm_overlap",
)


class Planner:
    """Plans one model on one machine; caches what many layouts share."""

    def __init__(
        self,
        model: ModelPreset,
        hardware: Hardware | timing.TimeModel,
        global_batch_size: int,
        gpus: int,
    ) -> None:
        self.model, self.gbs, self.gpus = model, global_batch_size, gpus
        self.time = time_model(hardware)
        self.hardware = self.time.hardware
        self.base = pretrain_config(Layout(), model.flags, 1).gpt_config(model.vocab_size)
        self._costs: dict[tuple, timing.ActionCosts | None] = {}
        self._gpts: dict[tuple, GPTConfig | None] = {}
        # results of pure functions of a layout's parts (model state, held counts, bytes)
        self._memos: dict[tuple, object] = {}
        self._bounds: dict[tuple, float] = {}
        self._schedules: dict[tuple, Schedule | str] = {}
        # per schedule, the first costs simulated with it and every rank's last event then
        self._references: dict[tuple, tuple[timing.ActionCosts, list[float]]] = {}
        # of the layouts fast enough to be checked after simulating: how many fitted, how
        # many did not (where most do not, checking first saves the simulations)
        self._fitted = self._over = 0
        self._checked_first = 0  # layouts checked before simulating, over every plan

    def gpt(self, layout: Layout) -> GPTConfig | None:
        """The model under ``layout`` as ``pretrain_gpt.py`` builds it from the model's flags
        and the layout's settings that reach the model (tensor and context parallelism,
        sequence parallelism, recompute, expert parallelism); None where its rules refuse
        them."""
        key = _model_key(layout)
        if key not in self._gpts:
            # enough data-parallel ranks for one copy of the expert grid
            model_only = Layout(
                **dict(zip(MODEL_FIELDS, key, strict=True)), dp=layout.ep * layout.expert_tp
            )
            try:
                config = pretrain_config(model_only, self.model.flags, model_only.dp)
                self._gpts[key] = config.gpt_config(self.model.vocab_size)
            except (ArgumentsError, ValueError):
                self._gpts[key] = None
        return self._gpts[key]

    def _memo(self, fn, *args):
        """``fn(*args)``, once per arguments (a GPTConfig or a Schedule among them is one of
        :meth:`gpt`'s or :meth:`schedule`'s, which live as long as the planner, so it is
        known by its identity)."""
        key = (fn, *(id(a) if isinstance(a, GPTConfig | Schedule) else a for a in args))
        if key not in self._memos:
            self._memos[key] = fn(*args)
        return self._memos[key]

    def _stage_layers(self, gpt: GPTConfig, placement) -> list[int]:
        """Every virtual stage's layer count under ``placement``."""
        return [len(r) for r in self._memo(placement_layer_ranges, gpt, placement)]

    def rank_states(self, layout: Layout, gpt: GPTConfig, placement) -> list[float]:
        """Every pipeline rank's model state in bytes (:func:`rank_state`): ZeRO shards it
        over the data- and context-parallel ranks, the experts' over their data-parallel
        ranks."""
        edp = expert_data_parallel_size(gpt, layout.world_size, layout.pp)
        dp, zero = layout.dp * layout.cp, layout.zero_stage
        return self._memo(self._rank_totals, gpt, placement, dp, zero, edp)

    def _rank_totals(self, gpt: GPTConfig, placement, dp: int, zero: int, edp: int) -> list[float]:
        layers = self._stage_layers(gpt, placement)
        last = len(layers) - 1
        # a rank's state depends only on its chunks' layers and which hold an end of the model
        kinds = [tuple([(layers[st], st == 0, st == last) for st in row]) for row in placement]
        totals: dict[tuple, float] = {}
        for key, row in zip(kinds, placement, strict=True):
            if key not in totals:
                totals[key] = rank_state(gpt, row, layers, dp, zero, edp).total
        return [totals[key] for key in kinds]

    def state_fits(self, layout: Layout, gpt: GPTConfig, placement) -> bool:
        """Whether every rank's model state alone fits in memory (a bound on the total)."""
        return max(self.rank_states(layout, gpt, placement)) <= self.hardware.usable_memory

    def memory_floor(self, layout: Layout, gpt: GPTConfig, schedule: Schedule) -> float:
        """A floor on ``layout``'s predicted peak memory (:func:`predict_memory`, which needs
        the checked config): the worst rank's model state and what its schedule holds at
        once (activations, and what a split backward keeps from ``I`` to ``W``), with a
        forward's working memory just after each forward."""
        walks = self._memo(self._schedule_walks, schedule)
        return self._held_floor(layout, gpt, schedule.placement, walks)

    def opening_floor(self, layout: Layout, gpt: GPTConfig) -> float:
        """A floor below :meth:`memory_floor`'s, before the schedule is built: what every
        rank holds over its first actions (the schedule kind's ``opening``, where it has one
        cheaper than the whole; ``-inf`` otherwise, and once the schedule is built)."""
        key = self._schedule_key(layout)
        opening = _kind(layout).opening
        if opening is None or key in self._schedules:
            return -math.inf
        walks = self._memo(self._opening_walks, opening, *key[1:])
        if walks is None:
            return -math.inf
        placement = self._placement(layout.pp, layout.vpp, _kind(layout).v_shaped)
        return self._held_floor(layout, gpt, placement, walks)

    @classmethod
    def _opening_walks(cls, opening, pp: int, m: int, vpp: int) -> list[HeldWalk] | None:
        """Every rank's walk over ``opening(pp, m, vpp)``; None where it refuses those
        sizes (building the schedule says why)."""
        try:
            actions = opening(pp, m, vpp)
        except ValueError:
            return None
        return cls._held_walks(actions, vpp)

    @staticmethod
    def _held_walks(actions, num_chunks: int) -> list[HeldWalk]:
        return [held_walk(rank_actions, num_chunks) for rank_actions in actions]

    @classmethod
    def _schedule_walks(cls, schedule: Schedule) -> list[HeldWalk]:
        return cls._held_walks(schedule.actions, schedule.num_chunks)

    def _held_floor(
        self, layout: Layout, gpt: GPTConfig, placement, walks: list[HeldWalk]
    ) -> float:
        """The worst rank's model state and the floor of ``walks[rank]``'s held bytes."""
        layers = self._stage_layers(gpt, placement)
        states = self.rank_states(layout, gpt, placement)
        s, b, last = self.model.seq_length // layout.cp, layout.micro_batch_size, len(layers) - 1
        fused = self.hardware.transport == "gloo"  # on CPUs
        floor = 0.0
        for rank, row in enumerate(placement):
            sizes = [
                self._memo(chunk_activation_bytes, gpt, layers[st], st == 0, st == last, s, b)
                for st in row
            ]
            stores = [
                self._memo(weight_grad_store_bytes, gpt, layers[st], st == last, s, b) for st in row
            ]
            working = [
                self._memo(
                    chunk_working_bytes, gpt, layers[st], st == last, Op.FORWARD, s, b, fused
                )
                for st in row
            ]
            floor = max(floor, states[rank] + walks[rank].floor(sizes, stores, working))
        return floor

    @staticmethod
    def _key(layout: Layout) -> tuple:
        """What a layout's action costs depend on: all but the schedule, save its shape."""
        return (*_costs_key(layout), _kind(layout).v_shaped)

    def costs(self, layout: Layout) -> timing.ActionCosts | None:
        """Action costs of ``layout`` (None when its model state alone overflows memory),
        shared by every schedule with the same placement."""
        return self._keyed_costs(layout, self._key(layout))

    def _keyed_costs(self, layout: Layout, key: tuple) -> timing.ActionCosts | None:
        costs = self._costs.get(key, _UNPRICED)
        if costs is not _UNPRICED:
            return costs
        gpt = self.gpt(layout)
        placement = self._placement(layout.pp, layout.vpp, v_shaped=key[-1])
        costs = None
        if gpt is not None and self.state_fits(layout, gpt, placement):
            mbs, dp, seq = layout.micro_batch_size, layout.dp, self.model.seq_length
            shape = timing.Shape(seq, mbs, placement, dp, layout.zero_stage, _BUCKET)
            costs = self.time.action_costs(gpt, shape)
            m = self.gbs // (mbs * dp)
            bounds = costs.lower_bounds(m, self.hardware.step_overhead)
            for split, bound in zip((False, True), bounds, strict=True):
                self._bounds[(*key, split)] = bound
        self._costs[key] = costs
        return costs

    @staticmethod
    def _splits(gpt: GPTConfig, pp: int, vpp: int) -> bool:
        """Whether ``pretrain_gpt.py`` splits ``gpt``'s layers over ``pp`` ranks of ``vpp``
        chunks (Megatron's rules: :func:`check_layer_split`). The enumeration lays out the
        sizes it refuses too, to count them; the search drops them unpriced."""
        try:
            check_layer_split(
                gpt.num_layers,
                pp,
                vpp if vpp != 1 else None,
                first=gpt.num_layers_in_first_pipeline_stage,
                last=gpt.num_layers_in_last_pipeline_stage,
                embedding=gpt.account_for_embedding_in_pipeline_split,
                loss=gpt.account_for_loss_in_pipeline_split,
            )
        except ValueError:
            return False
        return True

    def _placement(self, pp: int, vpp: int, v_shaped: bool) -> tuple[tuple[int, ...], ...]:
        """The virtual stages of every pipeline rank, in a V or looped (built once per
        shape)."""
        return self._memo(v_placement, pp) if v_shaped else self._memo(looped_placement, pp, vpp)

    def busy_floor(self, layout: Layout, gpt: GPTConfig, placement) -> float:
        """A floor on ``layout``'s time below its :meth:`bound` and cheaper, from its
        chunks' compute alone (a transfer never shortens an action): its microbatches'
        forwards and backwards spread evenly over its pipeline ranks (the busiest computes
        at least the average), and the first stage's ``m`` forwards, then the last
        microbatch's way down the pipeline and back and the first stage's ``W`` (the
        bound's chain without its messages and tail). ``-inf`` for a time model other
        than devices of their own."""
        if not isinstance(self.time, timing.Devices):
            return -math.inf
        mbs = layout.micro_batch_size
        total, first, chain = self._memo(self._compute_seconds, gpt, mbs, placement)
        m = self.gbs // (mbs * layout.dp)
        return self.hardware.step_overhead + max(m * total / layout.pp, (m - 1) * first + chain)

    def _screen(self, layout: Layout) -> float | str:
        """What ``layout`` is before any pricing: "invalid" (the model's own rules refuse
        it, or its layers' split over the pipeline), "memory" (a rank's model state alone
        overflows), else its :meth:`busy_floor`. A function of :meth:`_key`: the layouts
        that differ only in their schedule's name share it."""
        gpt = self.gpt(layout)
        if gpt is None or not self._memo(self._splits, gpt, layout.pp, layout.vpp):
            return "invalid"
        placement = self._placement(layout.pp, layout.vpp, _kind(layout).v_shaped)
        if not self.state_fits(layout, gpt, placement):
            return "memory"
        return self.busy_floor(layout, gpt, placement)

    def _compute_seconds(self, gpt: GPTConfig, mbs: int, placement) -> tuple[float, float, float]:
        """One microbatch's forward and whole backward through every chunk of
        ``placement``, the first stage's forward, and the way through every forward and
        input gradient then the first stage's ``W``, before transfers."""
        prices = chunk_prices(gpt, self.model.seq_length, mbs, self.hardware)
        layers = prices.stage_layers(placement)
        last = len(layers) - 1
        seconds = [prices.seconds(n, stage == 0, stage == last) for stage, n in enumerate(layers)]
        first_f, _, first_w = seconds[0]
        total = sum(f + i + w for f, i, w in seconds)
        return total, first_f, sum(f + i for f, i, _ in seconds) + first_w

    def bound(self, layout: Layout) -> float | None:
        """The lower bound on ``layout``'s time; None when it overflows memory."""
        key = self._key(layout)
        if self._keyed_costs(layout, key) is None:
            return None
        return self._bounds[(*key, _kind(layout).split_backward)]

    def _schedule_key(self, layout: Layout) -> tuple:
        """What ``layout``'s schedule is built from: its name, p, m and v."""
        num_microbatches = self.gbs // (layout.micro_batch_size * layout.dp)
        return (layout.schedule, layout.pp, num_microbatches, layout.vpp)

    def schedule(self, layout: Layout) -> Schedule | str:
        """The schedule ``layout`` runs (built once per name and sizes), or "invalid"."""
        key = self._schedule_key(layout)
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
        transport), "slower" (not under ``cutoff`` seconds), "bounded" (not under it by
        :meth:`scaled_bound`, without simulating), "memory" (does not fit). A layout is
        simulated, on devices every rank's end first, and checked and its memory predicted
        only if fast enough, then given its full timeline. Where most layouts checked so far
        did not fit (models whose activations fill the devices: their state alone passed),
        each is checked first instead: a few milliseconds against tens for a simulation.
        Either order gives the same prediction; only the counts of why others were dropped
        differ."""
        key = self._schedule_key(layout)
        if isinstance(self._schedules.get(key), str):  # built before: invalid, or deadlocks
            return self._schedules[key]
        if self.scaled_bound(layout, costs) >= cutoff:
            return "bounded"
        gpt = self.gpt(layout)
        if self.opening_floor(layout, gpt) > self.hardware.usable_memory:
            return "memory"
        schedule = self.schedule(layout)
        if isinstance(schedule, str):
            return schedule
        if self.memory_floor(layout, gpt, schedule) > self.hardware.usable_memory:
            return "memory"
        checked = None
        if self._over > 2 * self._fitted + 8:
            self._checked_first += 1
            checked = self._fits(layout)
            if isinstance(checked, str):
                return checked
        try:
            if isinstance(self.time, timing.Devices) and not schedule.asynchronous:
                # every rank's end first, without the timeline's events: most are slower
                ends = finish_times(schedule, timing.cost_model(costs, self.hardware))
                self._references.setdefault(key, (costs, ends))
                finish = max(end + tail for end, tail in zip(ends, costs.tail, strict=True))
                if finish + self.hardware.step_overhead >= cutoff:
                    return "slower"
                checked = checked or self._counted_fits(layout)
                if isinstance(checked, str):
                    return checked
            costs, timeline = self.time.run(schedule, costs, layout.world_size)
        except ScheduleError:  # a property of the schedule alone: remember it
            self._schedules[key] = "deadlock"
            return "deadlock"
        if max(step_time.rank_finish(costs, timeline)) + self.hardware.step_overhead >= cutoff:
            return "slower"
        checked = checked or self._counted_fits(layout)
        if isinstance(checked, str):
            return checked
        config, memory = checked
        gpt = config.gpt_config(self.model.vocab_size)
        step = step_time.step_time(config, gpt, costs, timeline, self.hardware)
        return Planned(layout, memory, step)

    def _counted_fits(self, layout: Layout) -> tuple[PretrainConfig, float] | str:
        """:meth:`_fits`, counting how many fit and how many are over memory."""
        checked = self._fits(layout)
        if checked == "memory":
            self._over += 1
        elif not isinstance(checked, str):
            self._fitted += 1
        return checked

    def _fits(self, layout: Layout) -> tuple[PretrainConfig, float] | str:
        """``layout``'s checked config and its largest predicted memory, or why it is
        dropped: "invalid" (refused by ``pretrain_gpt.py``'s checks), "memory"."""
        config = self._config(layout)
        if config is None:
            return "invalid"
        predicted = predict_memory(config, self.model.vocab_size, self.hardware.transport)
        memory = max(r.total for r in predicted)
        if memory > self.hardware.usable_memory:
            return "memory"
        return config, memory

    def scaled_bound(self, layout: Layout, costs: timing.ActionCosts) -> float:
        """A lower bound on ``layout``'s time under ``costs``, from its schedule's first
        simulation under other costs (``-inf`` before one). A simulated rank's last event
        ends at the longest of its chains of actions and messages, each a sum of
        durations: with every duration at least ``a`` times the reference's, each rank
        ends no sooner than ``a`` times its reference end."""
        key = self._schedule_key(layout)
        if key not in self._references:
            return -math.inf
        reference, ends = self._references[key]
        scale = math.inf
        for name in ("forward", "input_grad", "weight_grad", "whole_backward"):
            for now, then in zip(getattr(costs, name), getattr(reference, name), strict=True):
                scale = min(scale, *(a / b for a, b in zip(now, then, strict=True) if b > 0))
        if reference.p2p > 0:
            scale = min(scale, costs.p2p / reference.p2p)
        if not math.isfinite(scale):
            return -math.inf
        finish = max(scale * end + tail for end, tail in zip(ends, costs.tail, strict=True))
        return finish + self.hardware.step_overhead

    def _config(self, layout: Layout) -> PretrainConfig | None:
        try:
            return pretrain_config(layout, self.model.flags, self.gbs)
        except (ArgumentsError, ValueError):
            return None

    def plan(
        self,
        gpus_per_node: int,
        top_k: int,
        space: Space | None = None,
        progress: Callable[[str], object] | None = None,
    ) -> PlanResult:
        """The ``top_k`` fastest layouts that fit, fastest first (in ``space``, default
        :class:`Space`'s limits). ``progress``, where given, is called with "bounded" for
        every layout enumerated, then with "simulated" for every one the search visits."""
        # The search makes millions of small objects (messages, steps, events) and keeps
        # many in its caches, none in reference cycles: the cyclic collector would only
        # rescan them, over and over (a third of the time of a large search).
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._plan(gpus_per_node, top_k, space or Space(), progress)
        finally:
            if collecting:
                gc.enable()

    def _plan(
        self,
        gpus_per_node: int,
        top_k: int,
        space: Space,
        progress: Callable[[str], object] | None,
    ) -> PlanResult:
        start = time.perf_counter()
        result = PlanResult(best=[])
        seq = self.model.seq_length
        if not self.hardware.overlap_communication:  # --tp-comm-overlap would hide nothing
            space = dataclasses.replace(space, tp_comm_overlap=False)
        found = layouts(self.base, self.gpus, gpus_per_node, self.gbs, space, seq_length=seq)
        floored: list[tuple[float, int, Layout]] = []
        screened: dict[tuple, float | str] = {}  # per cost key: the screen's outcome
        for index, layout in enumerate(found):
            result.enumerated += 1
            if progress is not None:
                progress("bounded")
            key = self._key(layout)
            outcome = screened.get(key)
            if outcome is None:
                outcome = screened[key] = self._screen(layout)
            if outcome == "invalid":
                result.invalid += 1
            elif outcome == "memory":
                result.over_memory += 1
            else:
                floored.append((outcome, index, layout))
        floored.sort(key=lambda item: (item[0], item[1]))
        # Layouts are visited in order of their bound, which is priced only once every
        # layout of a lower floor has been: a bound is never below its floor
        bounded: list[tuple[float, int, Layout]] = []  # a heap
        pending = iter(floored)
        upcoming = next(pending, None)
        checked_before = self._checked_first
        while bounded or upcoming is not None:
            kth = result.best[top_k - 1].step.seconds if len(result.best) >= top_k else math.inf
            if upcoming is not None and (not bounded or upcoming[:2] < bounded[0][:2]):
                if upcoming[0] >= kth:  # every later bound is at least this floor
                    break
                _, index, layout = upcoming
                heapq.heappush(bounded, (self.bound(layout), index, layout))
                upcoming = next(pending, None)
                continue
            bound, _, layout = heapq.heappop(bounded)
            if bound >= kth:
                break
            if progress is not None:
                progress("simulated")
            outcome = self.evaluate(layout, self.costs(layout), kth)
            if isinstance(outcome, str):
                counter = _COUNTED[outcome]
                setattr(result, counter, getattr(result, counter) + 1)
            else:
                result.timed += 1
                result.best.append(outcome)
                result.best.sort(key=lambda planned: planned.step.seconds)
                del result.best[top_k:]
        result.checked_first = self._checked_first - checked_before
        result.seconds = time.perf_counter() - start
        return result
