"""Processes sharing a CPU's cores: the shared-cores simulator, the time model of a CPU
machine, its profile files, and the device time model's independence of all of it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megapp.pipeline_parallel import CostModel, ScheduleError, build_schedule, simulate
from megapp.pipeline_parallel.network import Rules
from megapp.planning.hardware import Hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.profiles import load_profile, predict_step_time
from megapp.planning.shared_cores import CpuProfile, SharedCores, simulate_shared
from megapp.planning.timing import action_costs, shape_of
from tests.support import GLOO_HARDWARE as GLOO
from tests.support import PLAIN_HARDWARE as PLAIN

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8"]
MODEL += ["--seq-length", "128", "--bf16"]
VOCAB = 1024

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
    costs = CostModel(forward=1.0, backward=2.0, update=0.5)
    plain, shared = simulate(schedule, costs), simulate_shared(schedule, costs, 2, 2 * p)
    assert _events(shared) == _events(plain)
    assert shared.peak_in_flight == plain.peak_in_flight


def test_a_message_is_work_at_both_its_ends():
    """1F1B, two ranks, one microbatch, a core each, 0.3 per message end: rank 1's
    forward receives the activation (1 + 0.3, from 1), its backward sends the gradient
    (2 + 0.3, from 2.3), and rank 0's backward does the activation's send and the
    gradient's receive (2 + 0.6, from 4.6)."""
    costs = CostModel(forward=1.0, backward=2.0, p2p_latency=0.3)
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
    blocking = CostModel(rules=Rules.NCCL_BATCHED)
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


def test_collective_overhead_is_per_call_and_a_rerun_forward_calls_again():
    """Two all-reduces per layer each way, the embedding's in the forward, the output
    layer's in the backward, the cross-entropy's three in the forward; full recompute
    makes the forward's calls again inside the backward."""
    slow = CpuProfile(PLAIN, SharedCores(collective_overhead=1e-3))
    for recompute in (None, "full"):
        cfg = pretrain_config(Layout(tp=2, recompute=recompute), MODEL, 16)
        gpt, shape = cfg.gpt_config(VOCAB), shape_of(cfg)
        base, called = action_costs(gpt, shape, PLAIN), slow.action_costs(gpt, shape)
        forward_calls, backward_calls = 8 * 2 + 1 + 3, 8 * 2 + 1
        if recompute == "full":
            backward_calls += forward_calls
        extra_f = called.tp_forward[0][0] - base.tp_forward[0][0]
        extra_b = called.tp_backward[0][0] - base.tp_backward[0][0]
        assert extra_f == pytest.approx(forward_calls * 1e-3)
        assert extra_b == pytest.approx(backward_calls * 1e-3)
        assert called.forward[0][0] - base.forward[0][0] == pytest.approx(extra_f)
        assert called.input_grad[0][0] - base.input_grad[0][0] == pytest.approx(extra_b)


def test_processes_sharing_cores_slow_by_how_many_compute_at_once():
    """8 processes on 2 cores: without a pipeline all 8 compute at once, so every action
    takes 4 times as long; a pipeline's fill and drain leave cores to the ranks that
    compute, so its first forward runs at full speed and its steady state near a quarter."""
    shared = CpuProfile(GLOO, SharedCores(cores=2))

    def computes(step):
        return [e for e in step.timeline.events if e.kind == "compute"]

    dp8 = pretrain_config(Layout(dp=8), MODEL, 32)
    alone, sharing = (predict_step_time(dp8, VOCAB, h) for h in (GLOO, shared))
    for a, b in zip(computes(alone), computes(sharing), strict=True):
        assert b.end - b.start == pytest.approx(4 * (a.end - a.start))
    pp4 = pretrain_config(Layout(pp=4, dp=2), MODEL, 32)
    alone, sharing = (predict_step_time(pp4, VOCAB, h) for h in (GLOO, shared))
    assert alone.seconds < sharing.seconds < 4 * alone.seconds
    durations = {}
    for step in (alone, sharing):
        first = [e for e in computes(step) if e.rank == 0]
        middle = first[len(first) // 2]
        durations[step is sharing] = (first[0].end - first[0].start, middle.end - middle.start)
    assert durations[True][0] == pytest.approx(durations[False][0])  # alone at the start
    ratio = durations[True][1] / durations[False][1]  # most of the time all 4 ranks busy
    assert 3 < ratio <= 4 + 1e-9
    # A core each changes nothing but how messages are priced (work at both their ends,
    # not a wait), so with messages free it is the plain prediction.
    free = dataclasses.replace(GLOO, intra_node_latency=0.0, intra_node_bandwidth=1e30)
    sixteen = CpuProfile(free, SharedCores(cores=16))
    plain = predict_step_time(pp4, VOCAB, free)
    assert predict_step_time(pp4, VOCAB, sixteen).seconds == pytest.approx(plain.seconds)


def test_a_core_each_prices_a_message_as_a_wait_plus_its_overhead():
    """Without ``cores`` a CPU machine runs the device simulator: its messages cost the
    overhead more, once, as a wait (not work at both ends)."""
    pp4 = pretrain_config(Layout(pp=4, dp=2), MODEL, 32)
    overhead = CpuProfile(GLOO, SharedCores(message_overhead=1e-3))
    gpt, shape = pp4.gpt_config(VOCAB), shape_of(pp4)
    assert overhead.action_costs(gpt, shape).p2p == action_costs(gpt, shape, GLOO).p2p + 1e-3
    devices = predict_step_time(pp4, VOCAB, dataclasses.replace(GLOO))
    assert predict_step_time(pp4, VOCAB, CpuProfile(GLOO)).seconds == devices.seconds
    assert predict_step_time(pp4, VOCAB, overhead).seconds > devices.seconds


SHARED = CpuProfile(
    dataclasses.replace(GLOO, gemm_flops=3e9, gpus_per_node=8),
    SharedCores(cores=2, uncontended_speedup=1.25, message_overhead=5e-4, collective_overhead=1e-3),
)


def test_a_cpu_profile_file_round_trips_and_the_flat_one_still_loads(tmp_path):
    """``save`` writes the device fields and the sharing apart and ``load_profile`` reads
    them back; the flat object earlier calibrations wrote (the sharing among the device's
    fields, ``shared_cores`` for the cores) loads as the same machine, and a flat device
    profile whose sharing fields are unset as a plain :class:`Hardware`."""
    path = tmp_path / "hardware.json"
    SHARED.save(path)
    assert set(json.loads(path.read_text())) == {"hardware", "shared_cores"}
    assert load_profile(str(path)) == SHARED
    flat = dataclasses.asdict(SHARED.hardware) | {
        "shared_cores": 2,
        "uncontended_speedup": 1.25,
        "message_overhead": 5e-4,
        "collective_overhead": 1e-3,
    }
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    assert load_profile(str(tmp_path / "flat.json")) == SHARED
    unset = {"shared_cores": None, "uncontended_speedup": 1.0, "message_overhead": 0.0}
    device = dataclasses.asdict(GLOO) | unset | {"collective_overhead": 0.0}
    (tmp_path / "device.json").write_text(json.dumps(device))
    assert load_profile(str(tmp_path / "device.json")) == GLOO
    assert isinstance(load_profile("h100"), Hardware)
    (tmp_path / "bad.json").write_text(json.dumps({"hardware": {}, "shared_cores": {"x": 1}}))
    with pytest.raises(ValueError, match=r"bad\.json is not a hardware profile"):
        load_profile(str(tmp_path / "bad.json"))


ROOT = Path(__file__).resolve().parents[1]
DEVICE_PATH = [*sorted((ROOT / "megapp" / "planning").glob("*.py")), ROOT / "megapp" / "plan.py"]
"""The device cost model, its profiles and the planner's search (the shared-cores package is
a folder of its own)."""


@pytest.mark.parametrize("path", DEVICE_PATH, ids=lambda p: p.name)
def test_the_device_time_model_reads_no_cpu_sharing_field(path):
    """No attribute access or keyword of a :class:`SharedCores` field (``.cores``,
    ``message_overhead=``, ...) anywhere on the device path."""
    names = "|".join(f.name for f in dataclasses.fields(SharedCores))
    reads = re.compile(rf"\.({names})\b|\b({names})\s*=(?!=)")
    assert not reads.findall(path.read_text()), path
