"""The search's shortcuts give what the long way gives: the lower bound it orders and stops
by is never above the simulated time, and the simulator's fast path for NCCL's rules gives
the timeline the network model gives."""

from __future__ import annotations

import dataclasses
import importlib
import math
import random

import pytest

from megapp.models.gpt import placement_layer_ranges
from megapp.pipeline_parallel.catalog import (
    ASYNC_SCHEDULES,
    SCHEDULES,
    asynchronous_run,
    build_schedule,
)
from megapp.pipeline_parallel.network import Rules
from megapp.planning import step_time, timing
from megapp.planning.hardware import load_hardware
from megapp.planning.layout import pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.models import ModelPreset
from megapp.planning.search import Planner

simulate = importlib.import_module("megapp.pipeline_parallel.simulate")

FLAGS = ("--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8")
FLAGS += ("--seq-length", "512", "--bf16")
MODEL = ModelPreset(FLAGS, 32000, "a small GPT")


def _scheduled(planner: Planner, found):
    """The layouts of ``found`` the planner would simulate, with their costs and schedule."""
    for layout in found:
        if planner.gpt(layout) is None or (costs := planner.costs(layout)) is None:
            continue
        schedule = planner.schedule(layout)
        if not isinstance(schedule, str):
            yield layout, costs, schedule


def test_the_bound_is_never_above_the_simulated_time():
    """Every 13th layout of a space with every schedule: the bound the search stops by is at
    most the time the simulation gives it (plus the step overhead, as the search adds)."""
    hardware = load_hardware("h100").with_gpus_per_node(4)
    planner = Planner(MODEL, hardware, 16, 8)
    space = Space(max_micro_batch_size=2)
    found = list(layouts(planner.base, 8, 4, 16, space, seq_length=MODEL.seq_length))
    checked = 0
    for layout, costs, schedule in _scheduled(planner, found[::13]):
        bound = planner.bound(layout)
        costs, timeline = planner.time.run(schedule, costs, layout.world_size)
        finish = max(step_time.rank_finish(costs, timeline)) + hardware.step_overhead
        assert bound <= finish * (1 + 1e-12), layout.name
        checked += 1
    assert checked > 30


@pytest.mark.parametrize("gpu", ["h100", "h100-ops"])
def test_the_busy_floor_is_never_above_the_bound(gpu):
    """Every layout of a space (every schedule, recompute, ZeRO stage and overlap), priced
    at one rate and by operation: the floor the search visits layouts by before it prices
    their bound is at most that bound, and close to it for some (it spares pricing)."""
    hardware = load_hardware(gpu).with_gpus_per_node(4)
    planner = Planner(MODEL, hardware, 16, 8)
    space = Space(max_micro_batch_size=2)
    ratios = []
    for layout in layouts(planner.base, 8, 4, 16, space, seq_length=MODEL.seq_length):
        gpt = planner.gpt(layout)
        if gpt is None or (bound := planner.bound(layout)) is None:
            continue
        floor = planner.busy_floor(layout, gpt, planner.costs(layout).placement)
        assert 0 < floor <= bound * (1 + 1e-12), layout.name
        ratios.append(floor / bound)
    assert len(ratios) > 300 and max(ratios) > 0.9


def test_a_pipeline_the_layers_do_not_split_over_is_refused_unpriced(monkeypatch):
    """The enumeration lays out every pipeline size, refused ones included, to count them:
    12 layers over 8 ranks (nor 13 or 14 with the loss or the embedding counted) are
    refused by pretrain_gpt.py, and the search counts them so without pricing one."""
    flags = ("--num-layers", "12", *FLAGS[2:])
    planner = Planner(ModelPreset(flags, 32000, "12 layers"), load_hardware("h100"), 16, 8)
    space = Space(max_micro_batch_size=2)
    found = list(layouts(planner.base, 8, 8, 16, space, seq_length=MODEL.seq_length))
    refused = [layout for layout in found if layout.pp == 8]
    assert refused and all(layout.vpp == 1 for layout in refused)
    with pytest.raises(ValueError, match="not divisible"):
        pretrain_config(refused[0], flags, 16)
    priced = []

    def action_costs(gpt, shape, hardware, price=timing.action_costs):
        priced.append(len(shape.placement))
        return price(gpt, shape, hardware)

    monkeypatch.setattr(timing, "action_costs", action_costs)
    result = planner.plan(8, 3, space)
    assert result.invalid >= len(refused) and result.best
    assert priced and 8 not in priced  # pipeline sizes priced: never the refused one


def test_layers_that_do_not_divide_are_split_with_the_embedding_and_the_loss_counted():
    """Six layers do not divide over four pipeline stages; six and the embedding and the
    loss do: the search lays out pp 4 that way alone (one chunk per rank, 1, 2, 2, 1
    layers, or two, 0, 1, 1, 1, 1, 1, 1, 0), each layout valid for pretrain_gpt.py and
    priced with those layers."""
    flags = ("--num-layers", "6", *FLAGS[2:])
    planner = Planner(ModelPreset(flags, 32000, "six layers"), load_hardware("h100"), 16, 8)
    space = Space(max_micro_batch_size=1, schedules=("1f1b", "interleaved-1f1b"))
    found = [lay for lay in layouts(planner.base, 8, 8, 16, space, seq_length=512) if lay.pp == 4]
    assert {(lay.vpp, lay.embedding_in_split, lay.loss_in_split) for lay in found} == {
        (1, True, True),
        (2, True, True),
    }
    want = {1: [1, 2, 2, 1], 2: [0, 1, 1, 1, 1, 1, 1, 0]}
    for layout, costs, schedule in _scheduled(planner, found):
        gpt = planner.gpt(layout)
        ranges = placement_layer_ranges(gpt, costs.placement)
        assert [len(r) for r in ranges] == want[layout.vpp], layout.name
        config = pretrain_config(layout, flags, 16)
        assert config.parallel.account_for_embedding_in_pipeline_split, layout.name
        assert schedule.num_chunks == layout.vpp


def _cases():
    for name in (*SCHEDULES, *ASYNC_SCHEDULES):
        for p, m, v in ((1, 3, 1), (2, 4, 1), (2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 8, 4)):
            try:
                schedule = build_schedule(name, p, m, v)
            except ValueError:
                continue
            yield asynchronous_run(schedule, 2) if schedule.asynchronous else schedule


@pytest.mark.parametrize("rules", [Rules.NCCL, Rules.GLOO])
@pytest.mark.parametrize("latency", [0.0, 0.01, 0.3])
def test_fast_path_gives_the_network_models_timeline(latency, rules, monkeypatch):
    """Uneven random costs per [rank][chunk]: the same events in the same order, and the
    same peak activations, as the general walk through the network model, under NCCL's
    rules and gloo's."""
    rng = random.Random(latency)
    cases = list(_cases())
    assert len(cases) > 30
    for schedule in cases:
        p, v = schedule.num_stages, schedule.num_chunks

        def table(p=p, v=v):
            return [[rng.uniform(0.5, 2.0) for _ in range(v)] for _ in range(p)]

        costs = simulate.CostModel(
            forward=table(),
            backward=table(),
            input_grad=table(),
            weight_grad=table(),
            activation=table(),
            weight_grad_memory=0.4,
            p2p_latency=latency,
            update=[rng.random() for _ in range(p)],
            rules=rules,
        )
        fast = simulate.simulate(schedule, costs)
        with monkeypatch.context() as patch:
            patch.setattr(simulate, "_simulate_channels", lambda *args: None)
            slow = simulate.simulate(schedule, costs)
        assert fast.events == slow.events, schedule.name
        assert fast.peak_in_flight == slow.peak_in_flight, schedule.name


def _random_costs(rng: random.Random, p: int, v: int, latency: float) -> simulate.CostModel:
    def table():
        return [[rng.uniform(0.5, 2.0) for _ in range(v)] for _ in range(p)]

    return simulate.CostModel(
        forward=table(),
        backward=table(),
        input_grad=table(),
        weight_grad=table(),
        p2p_latency=latency,
        rules=Rules.NCCL,
    )


def test_finish_times_are_the_timelines_rank_ends():
    """The search's quick simulation (no events kept) ends every rank where the full
    timeline does."""
    rng = random.Random(3)
    for schedule in _cases():
        if schedule.asynchronous:
            continue
        costs = _random_costs(rng, schedule.num_stages, schedule.num_chunks, 0.1)
        timeline = simulate.simulate(schedule, costs)
        assert simulate.finish_times(schedule, costs) == timeline.rank_ends()


def test_slower_costs_never_finish_sooner_than_their_scale():
    """What the search's second bound rests on: with every duration and the latency at
    least ``a`` times another cost model's, every rank ends no sooner than ``a`` times its
    end under that one (and not later than ``b`` times, with every one at most ``b``)."""
    rng = random.Random(5)
    for schedule in _cases():
        if schedule.asynchronous:
            continue
        p, v = schedule.num_stages, schedule.num_chunks
        base = _random_costs(rng, p, v, 0.2)

        def stretched(low, high, base=base, v=v):
            def grow(table):
                return [[x * rng.uniform(low, high) for x in row] for row in table]

            return simulate.CostModel(
                forward=grow(base.forward),
                backward=grow(base.backward),
                input_grad=grow(base.input_grad),
                weight_grad=grow(base.weight_grad),
                p2p_latency=base.p2p_latency * rng.uniform(low, high),
                rules=Rules.NCCL,
            )

        ends = simulate.finish_times(schedule, base)
        slower = simulate.finish_times(schedule, stretched(1.3, 2.0))
        faster = simulate.finish_times(schedule, stretched(0.5, 0.8))
        for end, late, early in zip(ends, slower, faster, strict=True):
            assert late >= 1.3 * end * (1 - 1e-12), schedule.name
            assert early <= 0.8 * end * (1 + 1e-12), schedule.name


def test_a_schedule_simulated_once_bounds_its_other_layouts():
    """The bound from a schedule's first simulation is never above a later layout's
    simulated time."""
    hardware = load_hardware("h100").with_gpus_per_node(4)
    planner = Planner(MODEL, hardware, 16, 8)
    found = list(layouts(planner.base, 8, 4, 16, Space(max_micro_batch_size=2), seq_length=512))
    checked = 0
    for layout, costs, schedule in _scheduled(planner, found):
        scaled = planner.scaled_bound(layout, costs)
        if scaled == -math.inf:  # the schedule's first layout: simulated, it is the reference
            assert planner.evaluate(layout, costs, cutoff=0.0) == "slower"
            continue
        ends = simulate.finish_times(schedule, timing.cost_model(costs, hardware))
        finish = max(end + tail for end, tail in zip(ends, costs.tail, strict=True))
        assert scaled <= (finish + hardware.step_overhead) * (1 + 1e-12), layout.name
        checked += 1
    assert checked > 100


def test_the_opening_floor_is_never_above_the_whole_schedules():
    """ZB-H2's floor from every rank's first actions, taken before its schedule is built,
    is at most the floor from all of them (so it refuses only what that one refuses), and
    mostly close to it: the opening is where a rank fills up."""
    planner = Planner(MODEL, load_hardware("h100").with_gpus_per_node(4), 64, 8)
    found = layouts(planner.base, 8, 4, 64, Space(max_micro_batch_size=2), seq_length=512)
    found = [lay for lay in found if lay.schedule == "zb-h2" and planner.costs(lay) is not None]
    # every opening first: no schedule is built yet
    openings = [planner.opening_floor(layout, planner.gpt(layout)) for layout in found]
    ratios = []
    for layout, opening in zip(found, openings, strict=True):
        gpt = planner.gpt(layout)
        schedule = planner.schedule(layout)
        if isinstance(schedule, str):
            continue
        whole = planner.memory_floor(layout, gpt, schedule)
        assert 0 < opening <= whole, layout.name
        assert planner.opening_floor(layout, gpt) == -math.inf  # built: the whole is known
        ratios.append(opening / whole)
    assert len(ratios) > 20
    assert sorted(ratios)[len(ratios) // 2] > 0.9, ratios
    # where the opening alone is over memory, the search refuses it without building it
    tight = load_hardware("h100").with_gpus_per_node(4)
    tight = dataclasses.replace(
        tight, memory_bytes=min(openings) + 0.5 * (max(openings) - min(openings))
    )
    planner = Planner(MODEL, tight, 64, 8)
    refused = 0
    for layout in found:
        costs, gpt = planner.costs(layout), planner.gpt(layout)
        if costs is not None and planner.opening_floor(layout, gpt) > tight.usable_memory:
            assert planner.evaluate(layout, costs) == "memory"
            assert planner.opening_floor(layout, gpt) > -math.inf  # still not built
            refused += 1
    assert refused > 10


def test_progress_counts_every_layout_bounded_then_every_one_visited():
    planner = Planner(MODEL, load_hardware("h100").with_gpus_per_node(4), 16, 8)
    phases: list[str] = []
    result = planner.plan(4, 3, Space(max_micro_batch_size=2), progress=phases.append)
    bounded = phases.count("bounded")
    assert bounded == result.enumerated
    assert set(phases[:bounded]) == {"bounded"} and set(phases[bounded:]) == {"simulated"}
    visited = result.timed + result.rescaled + result.over_memory + result.invalid
    visited += result.deadlocks
    assert 0 < len(phases) - bounded <= visited


MOE_FLAGS = (*FLAGS, "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256")


@pytest.mark.parametrize("flags", [FLAGS, MOE_FLAGS], ids=["dense", "moe"])
def test_the_memory_floor_is_never_above_the_predicted_memory(flags):
    """Every 5th layout pretrain_gpt.py accepts, every schedule, ZeRO stage and expert
    layout: the floor the search refuses by (state and held activations, no working memory,
    from the schedule alone) is at most the predicted peak, and the ranks' model states
    are predict_memory's."""
    from megapp.planning.memory import predict_memory

    model = ModelPreset(flags, 32000, "a small GPT")
    planner = Planner(model, load_hardware("h100").with_gpus_per_node(4), 16, 8)
    space = Space(max_micro_batch_size=2)
    found = list(layouts(planner.base, 8, 4, 16, space, seq_length=512))
    checked = 0
    for layout, _, schedule in _scheduled(planner, found[::5]):
        try:
            config = pretrain_config(layout, flags, 16)
        except ValueError:
            continue
        predicted = predict_memory(config, model.vocab_size)
        gpt = planner.gpt(layout)
        floor = planner.memory_floor(layout, gpt, schedule)
        assert 0 < floor <= max(r.total for r in predicted), layout.name
        states = planner.rank_states(layout, gpt, schedule.placement)
        assert states == pytest.approx([r.state - r.stashed for r in predicted]), layout.name
        checked += 1
    assert checked > 40
