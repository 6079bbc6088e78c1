"""The GPU planner check's tools on this machine: the calibration command on the CPU, a
training step measured and predicted, the replay of the steps an H200 measured, and the
kernel-time breakdown's classification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megapp.benchmarks import kernel_time, predicted_step
from megapp.benchmarks.step_models import STEP_MODELS, argv_flags
from megapp.planning import calibrate
from megapp.planning.hardware import load_hardware
from megapp.planning.microbench import MATMUL_PASSES, QUICK, matmul_call
from megapp.training.arguments import config_from_flags

DOCS = Path(__file__).resolve().parents[1] / "docs" / "img"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
TINY += ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"]


def test_calibrate_on_the_cpu_writes_a_profile_with_every_rate(tmp_path, capsys):
    out, figures = tmp_path / "p.json", tmp_path / "m.json"
    argv = ["--device", "cpu", "--base", "h100", "--quick", "--out", str(out)]
    assert calibrate.main([*argv, "--measurements", str(figures)]) == 0
    ops = load_hardware(str(out)).ops
    assert ops is not None and ops.matmul_flops > 0
    measured = {row[0] for row in ops.kernels}
    assert measured == {"layer_norm", "rms_norm", "bias_gelu", "bias_swiglu",
                        "bias_dropout_add", "rope", "relayout", "copy", "add"}  # fmt: skip
    assert "calibrated in" in capsys.readouterr().out
    # every kernel on smaller inputs too (their fixed cost per call), the matmuls in the
    # three layouts of a linear layer's passes; kept beside the fitted timings: every matmul
    # and attention shape back to back
    timings = json.loads(figures.read_text())
    small = {(row["op"], row["width"]) for row in timings["kernels_small"]}
    assert small == {(row["op"], row["width"]) for row in timings["kernels"]}
    assert len(small) == 5 * len(QUICK.kernel_widths) + 5
    assert {r["layout"] for r in timings["matmul"]} == {"forward", "input_grad", "weight_grad"}
    assert len(ops.gradient_matmul_flops) == 2 and ops.kernel_latency
    assert all(r["seconds_loop"] > 0 for r in timings["matmul"])
    assert all(r["backward_loop_s"] > 0 for r in timings["attention"])
    # the same measurements refitted give the same profile, with no device
    again = tmp_path / "again.json"
    assert calibrate.main(["--from-measurements", str(figures), "--base", "h100",
                           "--out", str(again)]) == 0  # fmt: skip
    assert load_hardware(str(again)) == load_hardware(str(out))


def test_calibrate_without_a_gpu_says_so_in_one_line(tmp_path, capsys):
    if calibrate.torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert calibrate.main(["--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_measured_seconds_leave_out_warm_up_and_profiled_iterations():
    records = [{"kind": "train", "iteration": i, "elapsed_ms_per_iteration": 100.0 * i}
               for i in range(1, 9)]  # fmt: skip
    assert predicted_step.measured_seconds(records, 3, 6) == [0.4, 0.5, 0.8]
    with pytest.raises(ValueError, match="warm-up"):
        predicted_step.measured_seconds(records, 8, None)


@pytest.mark.slow  # a pretrain_gpt.py job under torchrun
def test_a_step_is_measured_and_predicted(tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = ["--hardware", "h100", "--out", str(out), "--log", str(tmp_path / "job.log")]
    assert predicted_step.main([*argv, "--", *TINY, "--train-iters", "5"]) == 0
    report = json.loads(out.read_text())
    assert len(report["times_s"]) == 2  # iterations 4 and 5: 1-3 warm up
    assert report["ratio"] == pytest.approx(report["predicted_s"] / report["measured_s"])
    assert "predicted/measured" in capsys.readouterr().out


def test_the_h200_steps_replay_beside_their_measurements(capsys):
    """The steps an H200 measured (docs/img/h200_steps.json), predicted again on the
    profile its calibration gives: every kind of kernel has a measured and a predicted time."""
    steps = str(DOCS / "h200_steps.json")
    rows = predicted_step.replay(steps, str(DOCS / "h200_profile.json"))  # no device needed
    assert [r["held_out"] for r in rows] == [False] * 5 + [True] * 5
    for row in rows:
        assert row["ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"])
        measured, predicted = row["kinds"]["matmul"]
        assert measured > 0 and predicted > 0
    assert (
        predicted_step.main(["--replay", steps, "--hardware", str(DOCS / "h200_profile.json")]) == 0
    )
    table = capsys.readouterr().out
    assert table.count("\n| ") == 11  # the header and one row per step


@pytest.mark.parametrize("name", ["moe 16 experts 512 rows", "llama-style 1.0B"])
def test_a_step_is_broken_down_by_the_layers_it_has(name):
    """The kinds of work over a step add up to its predicted compute: a model of
    mixture-of-experts layers by their attention half, grouped expert matmuls and routing
    passes (priced as a dense MLP they would come out 1.5 times too long), a dense one by
    its layers."""
    flags = argv_flags(name, STEP_MODELS[name])
    config = config_from_flags(predicted_step.run_flags(flags, Path("unused.jsonl")), 1)
    report = predicted_step.prediction(config, str(DOCS / "h200_profile.json"))
    work = sum(seconds for kind, seconds in report["kinds"].items() if kind != "optimizer")
    assert work == pytest.approx(report["breakdown"]["step.compute"], rel=1e-3)
    assert report["kinds"]["matmul"] > 0 and report["kinds"]["memory"] > 0


def test_kernels_are_sorted_by_their_names():
    names = {
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>": "attention",
        "void megapp::cuda::bias_gelu_fwd_kernel<__nv_bfloat16>": "memory",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>": "optimizer",
    }
    assert {name: kernel_time.kind_of(name) for name in names} == names


def test_idle_time_is_the_span_no_kernel_covers():
    """Overlapping kernels cover their union; the gaps between them are the idle time, the
    longest first with the kernels on either side."""
    intervals = [(0.0, 2.0, "a"), (1.0, 3.0, "b"), (5.0, 6.0, "c"), (6.5, 7.0, "d")]
    idle = kernel_time.idle_time(intervals)
    assert idle["span_s"] == 7.0 and idle["idle_s"] == pytest.approx(2.5)
    assert idle["gap_count"] == 2
    assert idle["gaps"][0] == {"seconds": 2.0, "after": "b", "before": "c"}
    assert kernel_time.idle_time([])["gap_count"] == 0


def test_each_kernel_is_put_to_the_operator_that_launched_it():
    """By the kernel's External id, else through the launching call's correlation id to the
    innermost operator around that call on its thread; a kernel with neither is counted
    apart."""
    op = {"cat": "cpu_op", "ph": "X", "pid": 1, "tid": 2}
    call = {"cat": "cuda_runtime", "ph": "X", "pid": 1, "tid": 2, "dur": 2}
    kernel = {"cat": "kernel", "ph": "X", "pid": 0, "tid": 7}
    trace = {"traceEvents": [
        {**op, "name": "aten::linear", "ts": 0, "dur": 100,
         "args": {"External id": 1, "Input Dims": [[4, 8], [16, 8]], "Input Strides": []}},
        {**op, "name": "aten::addmm", "ts": 10, "dur": 50, "args": {"External id": 2}},
        {**call, "name": "cudaLaunchKernel", "ts": 20, "args": {"correlation": 7}},
        {**call, "name": "cudaMemsetAsync", "ts": 70, "args": {"correlation": 8}},
        {**kernel, "name": "gemm", "ts": 200, "dur": 30, "args": {"correlation": 7}},
        {**kernel, "name": "gemm", "ts": 300, "dur": 20, "args": {"correlation": 7}},
        {**kernel, "name": "tail", "ts": 350, "dur": 4, "args": {"External id": 1}},
        {**kernel, "cat": "gpu_memset", "name": "Memset (Device)", "ts": 240, "dur": 1,
         "args": {"correlation": 8}},
        {**kernel, "name": "orphan", "ts": 400, "dur": 2, "args": {"correlation": 99}},
    ]}  # fmt: skip
    rows = {(r["op"], r["kernel"]): r for r in kernel_time.operator_kernels(trace)}
    assert rows["aten::addmm", "gemm"]["calls"] == 2
    assert rows["aten::addmm", "gemm"]["seconds"] == pytest.approx(50e-6)
    assert rows["aten::linear", "tail"]["shapes"] == [[4, 8], [16, 8]]
    assert rows["aten::linear", "Memset (Device)"]["calls"] == 1  # after addmm ended
    assert rows["(no operator)", "orphan"]["calls"] == 1
    assert next(iter(rows)) == ("aten::addmm", "gemm")  # heaviest first


@pytest.mark.parametrize("layout", MATMUL_PASSES)
def test_each_matmul_layout_is_a_product_of_the_grid_shape(layout):
    """Every layout the calibration times has output [m, n] and reduction k (the forward,
    input-gradient and weight-gradient products of one linear layer)."""
    torch.manual_seed(0)
    out = matmul_call(24, 40, 56, layout, torch.device("cpu"), torch.float32)()
    assert out.shape == (24, 40)
    with pytest.raises(ValueError, match="unknown matmul layout"):
        matmul_call(2, 2, 2, "sideways", torch.device("cpu"), torch.float32)
