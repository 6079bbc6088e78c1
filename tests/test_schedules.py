"""Schedules and the simulator, in one process: the theory's numbers, every p."""

import dataclasses
from fractions import Fraction

import pytest

from megapp.pipeline_parallel.catalog import (
    SCHEDULE_KINDS,
    build_schedule,
    default_schedule,
    schedule_kind,
    schedule_placement,
)
from megapp.pipeline_parallel.messages import (
    ScheduleError,
    check_fifo,
    communication_plan,
    delivered_sends,
)
from megapp.pipeline_parallel.network import Rules
from megapp.pipeline_parallel.schedules import Action, Op
from megapp.pipeline_parallel.simulate import CostModel, simulate

F, B = Op.FORWARD, Op.BACKWARD


def _uniform(v: int = 1) -> CostModel:
    # each chunk holds 1/v of a stage's layers: tf = 1, tb = 2 per stage
    return CostModel(forward=1.0 / v, backward=2.0 / v)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(1, 9))
def test_bubble_and_peak_without_virtual_stages(name, p):
    for m in range(1, 17):
        timeline = simulate(build_schedule(name, p, m), _uniform())
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert timeline.makespan == pytest.approx((m + p - 1) * 3.0)
        expected = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
        assert timeline.peak_in_flight == expected, (name, p, m)


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(p, v):
    for m in range(p, 4 * p + 1, p):
        timeline = simulate(build_schedule("interleaved-1f1b", p, m, v), _uniform(v))
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_seed_examples():
    # p = 4: m = 8 gives 3/11 ≈ 27%, m = 32 gives 3/35 ≈ 8.6%
    for m, expected in ((8, Fraction(3, 11)), (32, Fraction(3, 35))):
        timeline = simulate(build_schedule("1f1b", 4, m))
        assert timeline.bubble_fraction == pytest.approx(float(expected))


def test_two_stages_two_chunks_validates():
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    plan = communication_plan(schedule)  # FIFO-consistent although next == prev rank
    assert len(plan) == 2
    assert schedule.actions[0][:5] == (
        Action(F, 0, 0),
        Action(F, 1, 0),
        Action(F, 0, 1),
        Action(F, 1, 1),
        Action(F, 2, 0),
    )
    assert schedule.warmup == (4, 2)


def test_1f1b_layout_matches_the_paper_figure():
    schedule = build_schedule("1f1b", 4, 8)
    assert [str(a) for a in schedule.actions[0][:6]] == ["F0", "F1", "F2", "F3", "B0", "F4"]
    assert [str(a) for a in schedule.actions[3][:4]] == ["F0", "B0", "F1", "B1"]
    assert schedule.warmup == (3, 2, 1, 0)


def test_uneven_stage_costs():
    # a last stage twice as slow sets the pace of the steady state
    costs = CostModel(forward=[[1.0], [1.0], [2.0]], backward=[[2.0], [2.0], [4.0]])
    timeline = simulate(build_schedule("1f1b", 3, 6), costs)
    assert timeline.busy(2) == pytest.approx(36.0)
    assert timeline.makespan >= 36.0 + 2 * 1.0 + 2 * 2.0  # fill and drain of the others


def test_latency_adds_to_every_hop():
    base = simulate(build_schedule("gpipe", 4, 1), CostModel(1.0, 2.0, 0.0)).makespan
    slow = simulate(build_schedule("gpipe", 4, 1), CostModel(1.0, 2.0, 0.5)).makespan
    assert slow - base == pytest.approx(6 * 0.5)  # 3 hops forward, 3 back


def test_per_action_messages_deadlock_interleaved_only_on_a_shared_communicator():
    """Posting each action's messages on their own: on one NCCL communicator per pipeline a
    send waiting for its receive blocks what the rank posted after it, and the ranks wait
    in a cycle; on a communicator per direction of each pair it runs as on gloo."""
    schedule = dataclasses.replace(
        build_schedule("interleaved-1f1b", 2, 4, 2), paired_steady_state=False
    )
    for rules in (Rules.NCCL_BATCHED, Rules.NCCL_SHARED):
        with pytest.raises(ScheduleError, match="deadlocks") as info:
            simulate(schedule, CostModel(rules=rules))
        assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
    nccl = simulate(schedule, CostModel(rules=Rules.NCCL)).bubble_fraction
    assert nccl == simulate(schedule, CostModel(rules=Rules.GLOO)).bubble_fraction


def test_receives_follow_the_send_order():
    schedule = build_schedule("1f1b", 2, 4)
    rank1 = list(schedule.actions[1])
    rank1[0], rank1[2] = rank1[2], rank1[0]  # rank 1 runs microbatch 1 before 0
    rank1[1], rank1[3] = rank1[3], rank1[1]
    swapped = dataclasses.replace(schedule, actions=(schedule.actions[0], tuple(rank1)))
    plan = communication_plan(swapped)
    # microbatch 1's step also receives microbatch 0, sent first; it waits in the inbox
    assert [(m.op, m.microbatch) for m in plan[1][0].recvs] == [(F, 0), (F, 1)]
    assert plan[1][2].recvs == ()
    simulate(swapped)
    broken = [list(steps) for steps in plan]
    broken[1][0] = broken[1][0]._replace(recvs=broken[1][0].recvs[::-1])
    with pytest.raises(ScheduleError, match="matched in posting order"):
        check_fifo(broken)


def test_backward_before_forward_is_rejected():
    schedule = build_schedule("gpipe", 2, 2)
    rank0 = (Action(B, 0), *schedule.actions[0][1:2], Action(F, 0), *schedule.actions[0][3:])
    broken = dataclasses.replace(schedule, actions=(rank0, schedule.actions[1]))
    with pytest.raises(ScheduleError, match="microbatch 0 chunk 0 as 'BF'"):
        communication_plan(broken)


def test_missing_action_is_rejected():
    schedule = build_schedule("gpipe", 2, 2)
    broken = dataclasses.replace(schedule, actions=(schedule.actions[0][:-1], schedule.actions[1]))
    with pytest.raises(ScheduleError, match="microbatch 1 chunk 0 as 'F'"):
        communication_plan(broken)


@pytest.mark.parametrize(
    "args, message",
    [
        (("interleaved-1f1b", 4, 2, 2), "as many microbatches as pipeline stages (4), got 2"),
        (("interleaved-1f1b", 4, 8, 1), "use 1f1b for one chunk per rank"),
        (("interleaved-1f1b", 1, 4, 2), "at least 2 pipeline stages"),
        (("1f1b", 4, 8, 2), "use interleaved-1f1b for virtual pipeline stages"),
        (("gpipe", 4, 0, 1), "num_microbatches must be an integer >= 1, got 0"),
        (("zb-x", 4, 8, 1), "unknown schedule 'zb-x'"),
        (("zb-v", 4, 8, 1), "two model chunks on every rank in a V"),
        (("dualpipev", 4, 7, 2), "at least 2p = 8 microbatches"),
    ],
)
def test_bad_schedule_arguments(args, message):
    with pytest.raises(ValueError) as info:
        build_schedule(*args)
    assert message in str(info.value)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_forward_only_schedules_validate(name, v):
    for p in range(2, 9):
        for m in range(p, 3 * p + 1, p):
            schedule = build_schedule(name, p, m, v).without_backward()
            timeline = simulate(schedule, _uniform(v))
            assert timeline.peak_in_flight == [0] * p  # evaluation keeps no activations
            assert all(a.op is F for acts in schedule.actions for a in acts)


def _held_activations(plan, delivered, rank: int) -> int:
    """Most activations ``rank`` has sent and not yet seen proven delivered."""
    held = peak = 0
    for step, proven in zip(plan[rank], delivered[rank], strict=True):
        held += sum(m.op is F for m in step.sends)
        held -= sum(m.op is F for m in proven)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize(
    "name, p, v",
    [
        ("gpipe", 4, 1),
        ("1f1b", 2, 1),
        ("1f1b", 4, 1),
        ("interleaved-1f1b", 2, 2),
        ("interleaved-1f1b", 4, 2),
        ("interleaved-1f1b", 3, 3),
    ],
)
def test_delivered_sends_are_proven_and_keep_memory_bounded(name, p, v):
    peaks = []
    for m in (p, 2 * p, 4 * p):
        plan = communication_plan(build_schedule(name, p, m, v))
        delivered = delivered_sends(plan)
        received_at = {msg: i for steps in plan for i, s in enumerate(steps) for msg in s.recvs}
        posted_at = {msg: i for steps in plan for i, s in enumerate(steps) for msg in s.sends}
        for rank, steps in enumerate(plan):
            proven = [msg for batch in delivered[rank] for msg in batch]
            assert len(proven) == len(set(proven))
            for index, batch in enumerate(delivered[rank]):
                for msg in batch:
                    assert msg.src == rank and posted_at[msg] <= index
                    # the peer posted something this step receives after it had msg
                    later = [x for x in steps[index].recvs if x.src == msg.dst]
                    assert any(posted_at[x] > received_at[msg] for x in later), (rank, msg)
        peaks.append([_held_activations(plan, delivered, r) for r in range(p)])
        in_flight = simulate(build_schedule(name, p, m, v)).peak_in_flight
        assert all(h < f for h, f in zip(peaks[-1], in_flight, strict=True)), (peaks, in_flight)
    if name != "gpipe":  # held sends stop growing with m: memory follows the schedule
        assert peaks[1] == peaks[2]
    if name == "1f1b":
        assert peaks[0] == [p - 1 - r for r in range(p)]


@pytest.mark.parametrize(
    "name, v",
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved-1f1b", 3),
        ("looped-bfs", 2),
        ("zb-h1", 1),
        ("zb-h2", 1),
        ("zb-v", 2),
        ("dualpipev", 2),
        ("pipedream", 1),
        ("pipedream-2bw", 1),
    ],
)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_schedule_names_its_placement_before_it_is_built(name, v, p):
    """What the model is built for (before the microbatches are known) is where the
    built schedule runs each stage."""
    assert schedule_placement(name, p, v) == build_schedule(name, p, 2 * p, v).placement


def test_placement_of_what_no_schedule_can_place_is_refused():
    with pytest.raises(ValueError, match="zb-v places two model chunks on every rank"):
        schedule_placement("zb-v", 2, 3)
    with pytest.raises(ValueError, match="unknown schedule 'v-shape'"):
        schedule_placement("v-shape", 2, 2)


@pytest.mark.parametrize("name", sorted(SCHEDULE_KINDS))
def test_a_catalog_entry_says_what_its_built_schedules_do(name):
    """The traits asked of a name before anything is built (V, split backward, steps among
    its actions, chunks per rank) are what every schedule its builder makes does."""
    kind = SCHEDULE_KINDS[name]
    chunk_counts = [v for v in (1, 2, 3) if kind.min_chunks <= v <= (kind.max_chunks or 3)]
    assert chunk_counts
    for p in (2, 4):
        for v in chunk_counts:
            schedule = build_schedule(name, p, 4 * p, v)
            ops = {a.op for row in schedule.actions for a in row}
            assert (Op.WEIGHT_GRAD in ops) == kind.split_backward == schedule.splits_backward
            assert (Op.UPDATE in ops) == kind.asynchronous == schedule.asynchronous
            assert schedule.ends_on_one_rank == kind.v_shaped
            assert schedule.placement == schedule_placement(name, p, v)
        for v in {1, 2, 3} - set(chunk_counts):
            with pytest.raises(ValueError, match=f"^{name} .* not {v}"):
                schedule_kind(name).check_chunks(v)


def test_the_default_schedule_is_one_catalog_entry_per_chunk_count():
    assert (default_schedule(1), default_schedule(2), default_schedule(4)) == (
        "1f1b",
        "interleaved-1f1b",
        "interleaved-1f1b",
    )
    defaults = {k.default_for: k.name for k in SCHEDULE_KINDS.values() if k.default_for}
    assert defaults == {"one": "1f1b", "several": "interleaved-1f1b"}
    assert schedule_kind("pipedream-vsync") is SCHEDULE_KINDS["pipedream"]  # as built
    with pytest.raises(ValueError, match="unknown schedule 'zb-w'; choose one of gpipe, 1f1b"):
        schedule_kind("zb-w")
