"""NCCL's point-to-point rules in the simulator, and what they cost each way of posting.

Under ``Rules.NCCL`` (megapp's posting on NCCL: one communicator per direction of each
pair of ranks, every message on its own) every schedule completes for every p from 2 to
8 and every m from 1 to 4p it accepts, with gloo's bubble; one batch per step on one
communicator (``NCCL_BATCHED``) or every message on one communicator (``NCCL_SHARED``)
deadlocks or loses bubble in the cases measured before megapp posted this way.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megapp.pipeline_parallel import forward_backward
from megapp.pipeline_parallel.catalog import SCHEDULE_KINDS, build_schedule
from megapp.pipeline_parallel.messages import Message, ScheduleError, Step, communication_plan
from megapp.pipeline_parallel.network import Network, Rules
from megapp.pipeline_parallel.p2p import Transport
from megapp.pipeline_parallel.schedule_search import search_schedule
from megapp.pipeline_parallel.schedules import Action, Op, Schedule
from megapp.pipeline_parallel.simulate import CostModel, simulate
from megapp.planning.hardware import load_hardware
from megapp.planning.layout_space import Space
from megapp.planning.models import MODELS
from megapp.planning.search import Planner
from megapp.testing import distributed

CHUNKS = {"interleaved-1f1b": 2, "looped-bfs": 2, "zb-h1": 2, "zb-v": 2, "dualpipev": 2}


def _costs(rules: Rules, v: int) -> CostModel:
    return CostModel(forward=1 / v, backward=2 / v, rules=rules)


def _cases(stages):
    for name in SCHEDULE_KINDS:
        for v in sorted({1, CHUNKS.get(name, 1)}):
            for p in stages:
                for m in range(1, 4 * p + 1):
                    try:
                        yield name, SCHEDULE_KINDS[name].build(p, m, v)
                    except ValueError:
                        continue  # not for this p, m, v


@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(range(2, 5), id="p2-4"),
        pytest.param(range(5, 9), id="p5-8", marks=pytest.mark.slow),
    ],
)
def test_every_schedule_completes_under_nccl_rules_with_gloos_bubble(stages):
    count = 0
    for name, schedule in _cases(stages):
        communication_plan(schedule)  # every schedule a builder accepts has a valid plan
        v = schedule.num_chunks
        gloo = simulate(schedule, _costs(Rules.GLOO, v))
        nccl = simulate(schedule, _costs(Rules.NCCL, v))
        label = f"{name} p={schedule.num_stages} m={schedule.num_microbatches} v={v}"
        assert nccl.bubble_fraction == pytest.approx(gloo.bubble_fraction, abs=0.01), label
        assert nccl.peak_in_flight == gloo.peak_in_flight, label
        count += 1
    assert count > 300


@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(range(2, 4), id="p2-3"),
        pytest.param(range(4, 6), id="p4-5", marks=pytest.mark.slow),
    ],
)
def test_the_searched_schedule_completes_under_nccl_rules_with_gloos_bubble(stages):
    """``auto``: the schedule searched under NCCL's rules, looped with one or two chunks
    per rank or the V, runs on gloo with the same bubble and no more activations."""
    count = 0
    for p in stages:
        for m in range(1, 4 * p + 1):
            for v, v_shape in ((1, False), (2, False), (2, True)):
                label = f"auto p={p} m={m} v={v}{' V' if v_shape else ''}"
                try:
                    found = search_schedule(
                        p, m, _costs(Rules.NCCL, v), num_chunks=v, v_shape=v_shape
                    )
                except ValueError:
                    continue  # no schedule for this p, m, v
                nccl = simulate(found.schedule, _costs(Rules.NCCL, v))
                gloo = simulate(found.schedule, _costs(Rules.GLOO, v))
                assert nccl.bubble_fraction == pytest.approx(gloo.bubble_fraction, abs=0.01), label
                assert nccl.peak_in_flight == gloo.peak_in_flight, label
                count += 1
    assert count >= 20 * len(stages)


@pytest.mark.parametrize(
    "name, p, m, v, batched, gloo",
    [
        ("zb-v", 4, 8, 2, None, 0.059),
        ("dualpipev", 4, 8, 2, None, 0.059),
        ("zb-h2", 4, 8, 1, None, 0.111),
        ("zb-h1", 4, 8, 1, 0.273, 0.111),
        ("interleaved-1f1b", 2, 3, 2, 0.400, 0.143),
    ],
)
def test_one_batch_per_step_on_one_communicator_deadlocks_or_loses_bubble(
    name, p, m, v, batched, gloo
):
    schedule = build_schedule(name, p, m, v)
    assert simulate(schedule, _costs(Rules.NCCL, v)).bubble_fraction == pytest.approx(
        gloo, abs=5e-4
    )
    if batched is None:
        with pytest.raises(ScheduleError, match="deadlocks under nccl-batched's rules"):
            simulate(schedule, _costs(Rules.NCCL_BATCHED, v))
    else:
        got = simulate(schedule, _costs(Rules.NCCL_BATCHED, v)).bubble_fraction
        assert got == pytest.approx(batched, abs=5e-4)


def test_a_send_holds_up_what_its_rank_posted_after_it_on_one_communicator():
    """1F1B on two ranks with every message alone on one communicator: rank 0's receive
    of the first gradient waits behind its send of the second activation, which rank 1
    receives only after sending that gradient. The report names the stream that blocks."""
    with pytest.raises(ScheduleError) as info:
        simulate(build_schedule("1f1b", 2, 4), CostModel(rules=Rules.NCCL_SHARED))
    report = str(info.value)
    assert "rank 0 before B0 waits for: recv of the gradient of microbatch 0" in report
    assert "behind the send of the activation of microbatch 1" in report


def _message(op: Op, microbatch: int, src: int, dst: int) -> Message:
    return Message(op, microbatch, src, dst, src, dst)


def test_a_batch_completes_as_one_and_a_stream_in_posting_order():
    """Rank 0 posts a batch of two sends; rank 1 receives one at t = 1, the other at
    t = 5: the batch completes at 5 (plus latency), as one. On one
    stream (``NCCL_SHARED``) a second send starts only once the first has completed."""
    a, b = _message(Op.FORWARD, 0, 0, 1), _message(Op.FORWARD, 1, 0, 1)
    net = Network(Rules.NCCL_BATCHED, latency=0.5)
    net.post(0, Step((a, b), (), None), now=0.0)
    net.post(1, Step((), (a,), None), now=1.0)
    assert net.waits(Step((a, b), (), None))[0].done is None
    net.post(1, Step((), (b,), None), now=5.0)
    (batch,) = net.waits(Step((a, b), (), None))
    assert batch.done == pytest.approx(5.5)
    # a met its receive at 1.5, but what the rank waits for is the batch
    assert batch.matched == {("send", a): pytest.approx(1.5), ("send", b): pytest.approx(5.5)}

    net = Network(Rules.NCCL_SHARED, latency=0.5)
    net.post(0, Step((a,), (), None), now=0.0)
    net.post(0, Step((b,), (), None), now=0.0)
    net.post(1, Step((), (b,), None), now=0.0)  # out of order on rank 1's stream: b waits
    net.post(1, Step((), (a,), None), now=2.0)
    assert net.ready_at(Step((), (a,), None)) is None  # a is behind b on rank 1's stream
    assert [u.done for u in net.unfinished()] == [None] * 4


def test_the_planner_drops_no_layout_for_its_transport():
    """The planner's pipeline on NCCL is the simulator's under megapp's posting: no
    layout of the space is dropped as deadlocking, zero-bubble and V schedules included."""
    planner = Planner(MODELS["tiny"], load_hardware("h100"), 16, 8)
    result = planner.plan(8, 3, Space(max_micro_batch_size=2))
    assert result.deadlocks == 0 and result.best


def _deadlocking_schedule() -> Schedule:
    """1F1B on two ranks with rank 0 running its first backward before its second
    forward, while rank 1 waits for that forward: a cycle on any transport."""
    plain = build_schedule("1f1b", 2, 2)
    rank0 = (
        Action(Op.FORWARD, 0, 0),
        Action(Op.BACKWARD, 0, 0),
        Action(Op.FORWARD, 1, 0),
        Action(Op.BACKWARD, 1, 0),
    )
    rank1 = (
        Action(Op.FORWARD, 0, 0),
        Action(Op.FORWARD, 1, 0),
        Action(Op.BACKWARD, 0, 0),
        Action(Op.BACKWARD, 1, 0),
    )
    return dataclasses.replace(plain, actions=(rank0, rank1), warmup=(0, 1))


def _never_called(iterator, chunk, inputs):
    raise AssertionError("a deadlocking schedule must be refused before anything runs")


@distributed(world_size=2)
def test_the_engine_refuses_a_deadlocking_schedule_before_any_message():
    with pytest.raises(ScheduleError, match="deadlocks"):
        forward_backward(_never_called, None, nn.Identity(), 2, schedule=_deadlocking_schedule())


@distributed(world_size=2)
def test_nccl_transport_needs_channels_only_between_ranks():
    """A pipeline group of one rank (pp 1) sends no message, so NCCL's one-way channels are
    not needed: a single-GPU NCCL run must not be refused. A group of two without them is."""
    ranks = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    with mock.patch.object(Transport, "backend", property(lambda self: "nccl")):
        Transport(ranks[dist.get_rank()], torch.device("cpu"))
        with pytest.raises(ValueError, match="one group per direction"):
            Transport(dist.group.WORLD, torch.device("cpu"))
