"""Calibration: fitted constants recovered from runs that went exactly as a known
hardware predicts, on devices of their own and on processes sharing cores."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from megapp.pipeline_parallel.messages import communication_plan
from megapp.planning.layout import Layout
from megapp.planning.profiles import load_profile
from megapp.planning.shared_cores import CpuProfile, SharedCores, calibrate
from megapp.planning.shared_cores.simulate import message_ends
from megapp.planning.timing import predict, shape_of
from megapp.training.launch import Launched
from tests.support import GLOO_HARDWARE as GLOO

ACTION = re.compile(r"^([FBIW])(\d+)(?:\.(\d+))?$")  # F3, or B3.1 for chunk 1


def synthetic(run, profile):
    """The profile record ``pretrain_gpt.py --profile-iteration`` would write if the
    machine ran ``run`` (a :class:`~megapp.planning.shared_cores.calibrate.Run`) exactly as
    ``profile`` predicts: an action's CPU time is its cost on a core of its own, a message
    end's the message's price."""
    layout = run.layout
    cfg = calibrate.pretrain_config(layout, calibrate.MODEL, run.global_batch)
    step = predict(cfg, calibrate.VOCAB, profile)
    costs = profile.action_costs(cfg.gpt_config(calibrate.VOCAB), shape_of(cfg))
    tables = {
        "F": costs.forward,
        "I": costs.input_grad,
        "W": costs.weight_grad,
        "B": costs.whole_backward,
    }
    ends = [sum(row) for row in message_ends(communication_plan(cfg.schedule))]

    def work(rank, name):
        kind, chunk = ACTION.match(name).group(1, 3)
        return tables[kind][rank][int(chunk or 0)]

    replicas = layout.world_size // layout.pp  # every process of a stage runs its timeline
    ranks = [
        {
            "rank": r * replicas + k,
            "tp": k % layout.tp,
            "pp": r,
            "dp": k // layout.tp,
            "events": [
                [e.kind, e.name, e.start, e.end] for e in step.timeline.events if e.rank == r
            ],
            "message_cpu_seconds": ends[r] * costs.p2p,
            "action_cpu_seconds": [
                work(r, e.name) for e in step.timeline.events if e.rank == r and e.kind == "compute"
            ],
        }
        for r in range(layout.pp)
        for k in range(replicas)
    ]
    record = {"kind": "profile", "seconds": step.seconds, "ranks": ranks}
    record["bubble"] = step.timeline.bubble_fraction
    return calibrate.Measurement(cfg, calibrate.VOCAB, record)


def test_calibration_recovers_known_constants():
    """Processes with a core each: a message is a wait, as on devices."""
    hardware = dataclasses.replace(
        GLOO,
        gemm_flops=3e9,
        intra_node_bandwidth=2e8,
        inter_node_bandwidth=2e8,
        intra_node_latency=4e-4,
        inter_node_latency=4e-4,
        layer_overhead=2e-3,
        action_overhead=5e-3,
        step_overhead=0.05,
        memory_bandwidth=1e9,
        gpus_per_node=8,
    )
    truth = CpuProfile(hardware, SharedCores(message_overhead=3e-3))
    measurements = [synthetic(run, truth) for run in calibrate.LAYOUTS]
    coef = calibrate.fit_actions(measurements)
    assert 1 / coef["flops"] == pytest.approx(3e9, rel=1e-6)
    assert coef["action"] == pytest.approx(5e-3, rel=1e-6)
    assert coef["layers"] == pytest.approx(2e-3, rel=1e-6)
    fitted = calibrate.fit_own_cores(measurements, memory_bandwidth=1e9)
    assert fitted.sharing.cores is None
    assert fitted.hardware.intra_node_bandwidth == pytest.approx(2e8, rel=1e-4)
    assert fitted.hardware.intra_node_latency == pytest.approx(4e-4, rel=1e-4)
    assert fitted.sharing.message_overhead == pytest.approx(3e-3, rel=1e-4)
    assert fitted.hardware.step_overhead == pytest.approx(0.05, rel=1e-4)
    for m in measurements:  # and so every iteration is predicted as it ran
        got = predict(m.config, m.vocab_size, fitted).seconds
        assert got == pytest.approx(m.record["seconds"], rel=1e-6)


def test_nonnegative_least_squares_drops_a_negative_coefficient():
    a = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    b = np.array([0.9, 2.1, 2.9])  # intercept would come out slightly negative
    x = calibrate.nonnegative_least_squares(a, b)
    assert (x >= 0).all() and x[1] == 0.0
    assert x[0] == pytest.approx(np.dot(a[:, 0], b) / np.dot(a[:, 0], a[:, 0]))


SHARED = CpuProfile(
    dataclasses.replace(
        GLOO,
        gemm_flops=3e9,
        intra_node_bandwidth=2e9,
        inter_node_bandwidth=2e9,
        intra_node_latency=0.0,  # a collective's steps are in its fixed cost
        inter_node_latency=0.0,
        action_overhead=2e-3,
        layer_overhead=1e-3,
        step_overhead=0.02,
        memory_bandwidth=1e9,
        gpus_per_node=8,
    ),
    SharedCores(cores=2, collective_overhead=1.5e-3, message_overhead=5e-4),
)
"""Eight processes on two cores whose every cost is work, as a calibration fits them."""


def test_shared_cores_fit_recovers_known_constants():
    """Every action's CPU time gives the rates and fixed costs back, the messages' CPU
    time their overhead, and the iterations the step overhead: every iteration is then
    predicted as it ran."""
    measurements = [synthetic(run, SHARED) for run in calibrate.LAYOUTS]
    fitted = calibrate.fit_shared_cores(measurements, 2, memory_bandwidth=1e9)
    assert fitted.sharing.cores == 2
    assert fitted.hardware.gemm_flops == pytest.approx(3e9, rel=1e-3)
    assert fitted.hardware.action_overhead == pytest.approx(2e-3, rel=1e-3)
    assert fitted.hardware.layer_overhead == pytest.approx(1e-3, rel=1e-3)
    assert fitted.sharing.collective_overhead == pytest.approx(1.5e-3, rel=1e-3)
    assert fitted.hardware.intra_node_bandwidth == pytest.approx(2e9, rel=1e-3)
    assert fitted.sharing.message_overhead == pytest.approx(5e-4, rel=1e-3)
    assert fitted.hardware.step_overhead == pytest.approx(0.02, rel=1e-3)
    for m in measurements:
        got = predict(m.config, m.vocab_size, fitted).seconds
        assert got == pytest.approx(m.record["seconds"], rel=1e-3)


def test_a_split_backward_pays_the_fixed_cost_of_two_actions():
    """ZB-H1 runs the layout of 1F1B with every backward split into I and W: the same
    FLOPs and messages, and per microbatch one more action's and its layer's fixed cost
    on every process (8 of them, over 2 cores)."""
    layout = Layout(tp=1, pp=4, dp=2, micro_batch_size=2)
    config = calibrate.pretrain_config(layout, calibrate.MODEL, 32)
    split = calibrate.pretrain_config(
        dataclasses.replace(layout, schedule="zb-h1"), calibrate.MODEL, 32
    )
    assert split.schedule.splits_backward and not config.schedule.splits_backward
    fixed = SHARED.hardware.action_overhead + SHARED.hardware.layer_overhead  # a layer a stage
    wall = (predict(c, calibrate.VOCAB, SHARED).seconds for c in (split, config))
    assert next(wall) - next(wall) == pytest.approx(8 * split.num_microbatches * fixed / 2)


def test_a_record_without_cpu_times_is_refused():
    m = synthetic(calibrate.LAYOUTS[0], SHARED)
    for rank in m.record["ranks"]:
        del rank["action_cpu_seconds"]
    with pytest.raises(ValueError, match="no action_cpu_seconds"):
        calibrate.fit_shared_cores([m], 2, memory_bandwidth=1e9)


def test_shared_cores_fit_wants_more_processes_than_cores():
    alone = synthetic(calibrate.Run(Layout(dp=2)), SHARED)
    with pytest.raises(ValueError, match="more processes than the 2 cores"):
        calibrate.fit_shared_cores([alone], 2, memory_bandwidth=1e9)


def test_the_uncontended_speedup_is_fitted_from_a_run_that_fits_on_the_cores():
    hardware = dataclasses.replace(GLOO, gemm_flops=3e9, gpus_per_node=8)
    truth = CpuProfile(hardware, SharedCores(cores=2, uncontended_speedup=1.3))
    alone = synthetic(calibrate.ALONE, truth)
    fitted = calibrate.fit_uncontended_speedup(alone, CpuProfile(hardware, SharedCores(cores=2)))
    assert fitted == pytest.approx(1.3, rel=1e-6)
    with pytest.raises(ValueError, match="no more processes than cores"):
        calibrate.fit_uncontended_speedup(synthetic(calibrate.Run(Layout(dp=4)), truth), truth)


def write_launch(path, seconds, ranks, profile_iteration=3, iterations=8):
    """A metrics file as a calibration launch writes it: every plain iteration took
    ``seconds`` (the first and the profiled ones took longer); ``ranks``: the profile's."""
    lines = []
    for i in range(1, iterations + 1):
        slow = i in (1, profile_iteration, profile_iteration + 1)
        lines.append(
            {
                "kind": "train",
                "iteration": i,
                "elapsed_ms_per_iteration": 1e3 * seconds * (3 if slow else 1),
            }
        )
    lines.append(
        {"kind": "profile", "iteration": profile_iteration, "seconds": seconds, "ranks": ranks}
    )
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_calibrate_fits_the_fastest_launch_of_metrics_left_beside_its_output(tmp_path, monkeypatch):
    """``calibrate(reuse=True, repeats=3)`` on metrics files whose launches took 30% more
    than a known iteration's time, 10% more, and the known time (their CPU times the known
    ones): the fastest launch is the known one, so the shared-cores fit (two cores, as on
    the development machine) recovers the constants."""
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(calibrate, "memory_bandwidth", lambda processes: 1e9)
    truth = dataclasses.replace(
        SHARED, sharing=dataclasses.replace(SHARED.sharing, uncontended_speedup=1.25)
    )
    for run, processes in [*((r, 8) for r in calibrate.LAYOUTS), (calibrate.ALONE, 1)]:
        m = synthetic(run, truth)
        assert m.config.world_size == processes
        for launch, factor in ((1, 1.3), (2, 1.0), (3, 1.1)):
            suffix = "" if launch == 1 else f".launch{launch}"
            path = tmp_path / f"{run.name}{suffix}.jsonl"
            write_launch(path, m.record["seconds"] * factor, m.record["ranks"])
    out = tmp_path / "hardware.json"
    fitted = calibrate.calibrate(8, out, verbose=False, reuse=True, repeats=3)
    assert load_profile(str(out)) == fitted
    assert fitted.sharing.cores == 2
    assert fitted.hardware.gemm_flops == pytest.approx(3e9, rel=1e-2)
    assert fitted.sharing.collective_overhead == pytest.approx(1.5e-3, rel=2e-2)
    assert fitted.sharing.message_overhead == pytest.approx(5e-4, rel=2e-2)
    assert fitted.sharing.uncontended_speedup == pytest.approx(1.25, rel=1e-2)


def test_a_run_is_launched_under_torchrun_and_its_metrics_read(tmp_path, monkeypatch):
    """``run_profile`` starts ``pretrain_gpt.py`` through the launcher with the run's
    layout, one profiled iteration and a metrics file, and holds the run to the median of
    the plain iterations that file records."""
    launched = []

    def fake_run_pretrain(nproc, flags, **options):
        launched.append((nproc, flags))
        metrics = flags[flags.index("--metrics-path") + 1]
        m = synthetic(calibrate.LAYOUTS[0], SHARED)
        write_launch(Path(metrics), 0.5, m.record["ranks"])
        return Launched(0, False, 1.0)

    monkeypatch.setattr(calibrate, "run_pretrain", fake_run_pretrain)
    run = calibrate.LAYOUTS[0]
    measured = calibrate.run_profile(run, 8, tmp_path)
    ((nproc, flags),) = launched
    assert nproc == 8
    assert flags[flags.index("--profile-iteration") + 1] == "3"
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(run.layout.tp)
    assert measured.seconds == 0.5 and measured.config.world_size == 8
