"""PipeDream and PipeDream-2BW as data: their actions, versions, checks and simulation."""

from dataclasses import replace

import pytest

from megapp.pipeline_parallel import (
    Action,
    CostModel,
    Op,
    ScheduleError,
    build_schedule,
    communication_plan,
    held_versions,
    one_f_one_b,
    pipedream,
    pipedream_2bw,
    simulate,
    stash_profile,
)
from megapp.pipeline_parallel.timeline import plot_timelines


def _ops(schedule, rank):
    return " ".join(str(a) for a in schedule.actions[rank])


def test_pipedream_is_1f1b_with_a_step_after_every_backward():
    s = pipedream(3, 2, iterations=2)  # four microbatches, no flush between the iterations
    assert s.num_microbatches == 4 and s.update_interval == 1 and s.asynchronous
    assert s.iterations == 2 and pipedream_2bw(3, 2, iterations=3).iterations == 3
    assert _ops(s, 0) == "F0 F1 F2 B0 U0 F3 B1 U1 B2 U2 B3 U3"
    assert _ops(s, 2) == "F0 B0 U0 F1 B1 U1 F2 B2 U2 F3 B3 U3"
    # each rank runs microbatch g on the weights of its steps so far
    assert s.versions == ((0, 0, 0, 1), (0, 0, 1, 2), (0, 1, 2, 3))
    vsync = pipedream(3, 2, iterations=2, vertical_sync=True)
    assert vsync.name == "pipedream-vsync"
    assert vsync.versions == ((0, 0, 0, 1),) * 3  # the first stage's, everywhere


def test_2bw_steps_once_per_iteration_on_the_weights_one_step_back():
    s = pipedream_2bw(2, 3, iterations=3)
    assert s.update_interval == 3 and s.microbatches_per_update == 3
    assert _ops(s, 0) == "F0 F1 B0 F2 B1 F3 B2 U0 F4 B3 F5 B4 F6 B5 U1 F7 B6 F8 B7 B8 U2"
    assert s.versions == ((-1, -1, -1, 0, 0, 0, 1, 1, 1),) * 2
    with pytest.raises(ValueError, match="at least p - 1 = 3 microbatches"):
        pipedream_2bw(4, 2)


def test_versions_held_follow_the_formulas():
    p = 4
    assert held_versions(pipedream(p, 4, iterations=4)) == [p - r for r in range(p)]
    assert held_versions(pipedream(p, 4, iterations=4, vertical_sync=True)) == [p] * p
    assert held_versions(pipedream_2bw(p, 4, iterations=4)) == [2] * p
    # copies beside the live weights: one per version where a microbatch in flight
    # across a step runs on the current one
    assert [stash_profile(pipedream(p, 4, iterations=4), r)[1] for r in range(p)] == [4, 3, 2, 0]
    assert [stash_profile(pipedream_2bw(p, 4, iterations=4), r)[1] for r in range(p)] == [
        2,
        2,
        2,
        1,
    ]


def test_checks_refuse_bad_steps_and_versions():
    good = pipedream(2, 2, iterations=1)
    communication_plan(good)
    early = replace(good, versions=((0, 1), (0, 1)))  # rank 0 has made no step before F1
    with pytest.raises(ScheduleError, match="version 1"):
        communication_plan(early)
    rows = [list(a) for a in good.actions]
    rows[1].remove(Action(Op.UPDATE, 1))
    with pytest.raises(ScheduleError, match="unapplied"):
        communication_plan(replace(good, actions=tuple(map(tuple, rows))))
    with pytest.raises(ScheduleError, match="update_interval"):
        communication_plan(replace(one_f_one_b(2, 2), versions=((0, 0), (0, 0))))


def test_catalog_builds_them_and_refuses_what_does_not_apply():
    assert build_schedule("pipedream-2bw", 2, 4, iterations=3).num_microbatches == 12
    assert build_schedule("pipedream", 2, 4, vertical_sync=True).name == "pipedream-vsync"
    with pytest.raises(ValueError, match="vertical sync applies to pipedream"):
        build_schedule("pipedream-2bw", 2, 4, vertical_sync=True)
    with pytest.raises(ValueError, match="flushes after every iteration"):
        build_schedule("1f1b", 2, 4, iterations=2)
    with pytest.raises(ValueError, match="one model chunk"):
        build_schedule("pipedream", 2, 4, 2)


def test_no_flush_removes_the_bubble_of_every_iteration_but_one():
    """k iterations of m microbatches: 1F1B flushes k times, the asynchronous schedules
    once, so their time is 1F1B's over k·m microbatches (steps cost nothing here)."""
    p, m, k = 4, 4, 4
    costs = CostModel(forward=1.0, backward=2.0)
    flushed = k * simulate(one_f_one_b(p, m), costs).makespan
    for name in ("pipedream", "pipedream-2bw"):
        timeline = simulate(build_schedule(name, p, m, iterations=k), costs)
        assert timeline.makespan == simulate(one_f_one_b(p, k * m), costs).makespan
        assert timeline.makespan == 3 * (k * m + p - 1) < flushed == 3 * k * (m + p - 1)
    # an optimizer step takes its time on every rank
    slow = simulate(pipedream_2bw(p, m, iterations=k), replace(costs, update=0.5))
    assert slow.makespan > simulate(pipedream_2bw(p, m, iterations=k), costs).makespan
    names = {e.name[:1] for e in slow.events if e.kind == "compute"}
    assert names == {"F", "B", "U"}


def test_timeline_draws_steps(tmp_path):
    pytest.importorskip("matplotlib")
    timeline = simulate(pipedream(2, 2, iterations=2), CostModel(update=0.3))
    path = tmp_path / "pipedream.png"
    plot_timelines([("pipedream", timeline.events)], path)
    assert path.stat().st_size > 0
