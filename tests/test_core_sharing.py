"""Processor sharing: the shared-cores simulator."""

from __future__ import annotations

import pytest

from megapp.pipeline_parallel import CostModel, ScheduleError, build_schedule, simulate
from megapp.planning.core_sharing import simulate_shared

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
    """Without messages' work (which the plain simulator prices as a wait)."""
    schedule = build_schedule(name, p, m, v)
    costs = CostModel(forward=1.0, backward=2.0, blocking_sends=False, update=0.5)
    plain, shared = simulate(schedule, costs), simulate_shared(schedule, costs, 2, 2 * p)
    assert _events(shared) == _events(plain)
    assert shared.peak_in_flight == plain.peak_in_flight


def test_a_message_is_work_at_both_its_ends():
    """1F1B, two ranks, one microbatch, a core each, 0.3 per message end: rank 1's
    forward receives the activation (1 + 0.3, from 1), its backward sends the gradient
    (2 + 0.3, from 2.3), and rank 0's backward does the activation's send and the
    gradient's receive (2 + 0.6, from 4.6)."""
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.3, blocking_sends=False)
    timeline = simulate_shared(build_schedule("1f1b", 2, 1), costs, 1, 2)
    spans = {(e.rank, e.name): (e.start, e.end) for e in timeline.events if e.kind == "compute"}
    assert spans[(0, "F0")] == pytest.approx((0.0, 1.0))
    assert spans[(1, "F0")] == pytest.approx((1.0, 2.3))
    assert spans[(1, "B0")] == pytest.approx((2.3, 4.6))
    assert spans[(0, "B0")] == pytest.approx((4.6, 7.2))


def test_a_rank_alone_runs_at_full_speed_and_shares_the_cores_otherwise():
    """Two stages of two processes each on two cores: rank 0's first forward runs alone at
    full speed, later actions of the two ranks overlap at half speed, and as some rank
    always computes the cores never idle: the iteration is all the work over the cores."""
    schedule = build_schedule("1f1b", 2, 4)
    costs = CostModel(forward=1.0, backward=2.0)
    timeline = simulate_shared(schedule, costs, processes_per_rank=2, cores=2)
    first = next(e for e in timeline.events if e.rank == 0 and e.kind == "compute")
    assert (first.start, first.end) == (0.0, 1.0)
    lengths = {e.end - e.start for e in timeline.events if e.kind == "compute"}
    assert max(lengths) == pytest.approx(4.0)  # a backward beside the other rank's work
    work = 2 * 2 * 4 * (1.0 + 2.0)  # ranks × processes × microbatches × (F + B)
    assert timeline.makespan == pytest.approx(work / 2)
    assert timeline.makespan > simulate(schedule, costs).makespan


def test_deadlock_is_reported():
    blocking = CostModel(blocking_sends=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_shared(build_schedule("zb-v", 4, 8, 2), blocking, 1, 4)


def test_processes_that_fit_on_the_cores_compute_at_the_uncontended_speed():
    """One process per rank on four cores: every action runs at 1.25 times its cost's rate
    throughout, so without message latency the timeline is the plain one scaled by 0.8;
    in a job of more processes than cores the speedup never applies."""
    schedule = build_schedule("1f1b", 2, 4)
    costs = CostModel(forward=1.0, backward=2.0)
    plain = simulate(schedule, costs)
    fast = simulate_shared(schedule, costs, 1, 4, uncontended_speedup=1.25)
    assert fast.makespan == pytest.approx(0.8 * plain.makespan)
    crowded = simulate_shared(schedule, costs, 4, 2, uncontended_speedup=1.25)
    assert crowded.makespan == pytest.approx(simulate_shared(schedule, costs, 4, 2).makespan)
    # a job of 4 processes on 2 cores: its first forward runs alone, on the 2 cores, yet at
    # the rate of processes that take turns
    larger = simulate_shared(schedule, costs, 2, 2, uncontended_speedup=1.25)
    first = next(e for e in larger.events if e.rank == 0 and e.kind == "compute")
    assert (first.start, first.end) == (0.0, 1.0)
