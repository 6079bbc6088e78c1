"""The schedule search: measured costs in, a validated schedule out, never worse than the
built-in schedules and better where their assumptions or memory needs do not fit."""

import pytest

from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS, SCHEDULES
from megapp.pipeline_parallel.messages import communication_plan
from megapp.pipeline_parallel.schedule_search import costs_from_events, search_schedule
from megapp.pipeline_parallel.simulate import CostModel, simulate

P, M = 4, 8


def _table(base: float, first: float, last: float) -> list[list[float]]:
    """One chunk per rank; the first stage also embeds, the last also computes the loss."""
    return [[base + (first if r == 0 else 0.0) + (last if r == P - 1 else 0.0)] for r in range(P)]


# forward, input gradient, weight gradient: a cheap W; a heavy last stage (output layer)
CHEAP_W = CostModel(forward=1.0, backward=1.5, input_grad=1.0, weight_grad=0.5)
UNEVEN = CostModel(
    forward=_table(1.0, 0.2, 0.8),
    backward=_table(2.0, 0.2, 1.6),
    input_grad=_table(1.2, 0.1, 0.8),
    weight_grad=_table(0.8, 0.1, 0.8),
    p2p_latency=0.05,
)


def _builtin_fitting(costs: CostModel, limit: float) -> tuple[float, float]:
    """The shortest built-in one-chunk schedule within ``limit``: (makespan, peak)."""
    eager = costs
    found = []
    for name, build in SCHEDULES.items():
        if SCHEDULE_KINDS[name].min_chunks > 1:  # a one-chunk placement only
            continue
        timeline = simulate(build(P, M, 1), eager)
        if max(timeline.peak_in_flight) <= limit:
            found.append((timeline.makespan, max(timeline.peak_in_flight)))
    return min(found)


def test_search_beats_every_builtin_schedule_that_fits_when_w_is_cheap():
    # 6 microbatches of activations: more than 1F1B and ZB-H1 hold, less than ZB-H2 needs
    result = search_schedule(P, M, CHEAP_W, memory_limit=6)
    communication_plan(result.schedule)  # validated like any schedule
    assert result.schedule.name == "auto"
    assert max(result.timeline.peak_in_flight) <= 6
    best, _ = _builtin_fitting(CHEAP_W, 6)
    assert result.timeline.makespan == pytest.approx(23.5) and best == pytest.approx(24.5)
    labels = [label for label, _, _ in result.candidates]
    assert labels[0].startswith("greedy") and "zb-h1" in labels and "zb-h2" not in labels


def test_search_matches_the_best_builtin_on_uneven_stages_with_less_memory():
    result = search_schedule(P, M, UNEVEN, memory_limit=P)
    best, peak = _builtin_fitting(UNEVEN, P)
    assert result.timeline.makespan <= best + 1e-9
    assert max(result.timeline.peak_in_flight) < peak  # the same time, one microbatch less


@pytest.mark.parametrize("v, v_shape", [(1, False), (2, False), (2, True)])
def test_search_is_never_worse_than_the_builtins_at_uniform_costs(v, v_shape):
    costs = CostModel(forward=1 / v, backward=2 / v, activation=1 / v)
    result = search_schedule(P, M, costs, num_chunks=v, v_shape=v_shape)
    builtin = [span for label, span, _ in result.candidates if not label.startswith("greedy")]
    assert result.timeline.makespan <= min(builtin)


def test_costs_are_read_back_from_a_recorded_iteration():
    schedule = SCHEDULES["zb-h1"](P, M, 1)
    truth = CostModel(
        forward=_table(1.0, 0.5, 0.25),
        backward=_table(3.0, 0.0, 0.0),
        input_grad=_table(2.0, 0.0, 0.0),
        weight_grad=_table(1.0, 0.0, 0.0),
    )
    events = simulate(schedule, truth).events
    measured = costs_from_events(schedule, events, p2p_latency=0.1)
    assert measured.forward == truth.forward
    assert measured.input_grad == truth.input_grad and measured.weight_grad == truth.weight_grad
    assert measured.backward == truth.backward and measured.p2p_latency == 0.1
    with pytest.raises(ValueError, match="every rank's forward and backward"):
        costs_from_events(schedule, [e for e in events if e.rank != 2])


def test_a_limit_nothing_fits_in_is_refused():
    with pytest.raises(ValueError, match="raise the memory limit"):
        search_schedule(P, M, CHEAP_W, memory_limit=0.5)
    with pytest.raises(ValueError, match="two chunks per rank"):
        search_schedule(P, M, CHEAP_W, v_shape=True)
