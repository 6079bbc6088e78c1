"""Processor sharing: the shared-cores simulator and its inverse for measured runs."""

from __future__ import annotations

import pytest

from megapp.pipeline_parallel import CostModel, ScheduleError, build_schedule, simulate
from megapp.planning.core_sharing import dedicated_seconds, simulate_shared

CASES = [
    ("1f1b", 4, 8, 1),
    ("interleaved-1f1b", 4, 8, 2),
    ("zb-h1", 4, 8, 1),
    ("zb-v", 4, 8, 2),
    ("pipedream-2bw", 4, 4, 1),
]


def _events(timeline):
    return sorted(
        (e.rank, e.kind, e.name, round(e.start, 9), round(e.end, 9)) for e in timeline.events
    )


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_a_core_per_process_is_the_plain_simulator(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.3, blocking_sends=False, update=0.5)
    plain, shared = simulate(schedule, costs), simulate_shared(schedule, costs, 2, 2 * p)
    assert _events(shared) == _events(plain)
    assert shared.peak_in_flight == plain.peak_in_flight


def test_a_rank_alone_runs_at_full_speed_and_shares_the_cores_otherwise():
    """Two stages of two processes each on two cores: rank 0's first forward runs alone,
    then the two ranks overlap at half speed; every action's work is still its cost."""
    schedule = build_schedule("1f1b", 2, 4)
    costs = CostModel(forward=1.0, backward=2.0)
    timeline = simulate_shared(schedule, costs, processes_per_rank=2, cores=2)
    first = next(e for e in timeline.events if e.rank == 0 and e.kind == "compute")
    assert (first.start, first.end) == (0.0, 1.0)
    assert timeline.makespan > simulate(schedule, costs).makespan
    computing = [(e.start, e.end) for e in timeline.events if e.kind == "compute" for _ in range(2)]
    for e in timeline.events:
        if e.kind == "compute":
            want = 1.0 if e.name.startswith("F") else 2.0
            assert dedicated_seconds(e.start, e.end, computing, 2) == pytest.approx(want)


def test_dedicated_seconds_by_hand():
    # 4 s alone on 1 core: 4 s of work; with a second process for the middle 2 s: 3 s
    assert dedicated_seconds(0, 4, [(0, 4)], 1) == pytest.approx(4)
    assert dedicated_seconds(0, 4, [(0, 4), (1, 3)], 1) == pytest.approx(3)
    assert dedicated_seconds(0, 4, [(0, 4), (1, 3)], 2) == pytest.approx(4)  # a core each


def test_deadlock_is_reported():
    blocking = CostModel(blocking_sends=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_shared(build_schedule("zb-v", 4, 8, 2), blocking, 1, 4)
