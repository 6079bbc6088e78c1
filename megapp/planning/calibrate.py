"""Measure one device's operation rates and write its hardware profile.

    python -m megapp.planning.calibrate --device cuda --out h200_measured.json
    python -m megapp.planning.calibrate --device cpu --base h100 --quick --out /tmp/p.json

After 1.5 s of matmuls (the clocks ramp up from idle) it times, on the device at hand
(CUDA events on a GPU; the median of several), each call on a GPU from a cold cache (a
buffer larger than the last-level cache written first) and after the device idled about as
long (a sleeping kernel), as a layer runs them: between other kernels, on operands other
kernels left in memory:

- **memory-bound kernels**, forward and backward: megapp's fused ops as this install runs
  them (layer and RMS norm, bias + GeLU, bias + SwiGLU, bias + dropout + residual) on 2^26
  elements at widths 1024 to 16384 (their speed depends on it), RoPE, the attention
  output's relayout, torch's copy and the fp32 gradient accumulation over a buffer many
  times the last-level cache, and all of them again on 2^22 elements (a kernel's fixed cost
  besides its bytes); bytes read plus written over time;
- **per-kernel costs**: a stream of tiny adds queued behind a sleeping kernel, so the device
  runs it back to back (seconds per kernel on the device) while the host's time to queue it
  is the launch cost;
- **matmuls** over a grid of shapes (16-bit on a GPU, fp32 on a CPU), each laid out as the
  forward (``x·Wᵀ``), input-gradient (``dy·W``) and weight-gradient (``dyᵀ·x``) passes of a
  linear layer run it;
- **fused attention** (``torch.nn.functional.scaled_dot_product_attention``, causal) forward
  and backward at eight shapes and two head dimensions, laid out as a layer's fused QKV
  projection makes them.

The matmuls and attention are timed back to back as well, after every single call (long
loops of large matmuls lower the clocks), and kept, not fitted: between two runs on H200s,
attention's back-to-back timings moved by up to 19%, its single calls by at most 5%.

:mod:`megapp.planning.op_fit` fits the operation model's rates to these timings
(:func:`~megapp.planning.op_fit.op_rates`), and the command prints how well each part fits.
The profile is ``--base`` (the built-in profile of this GPU by default: its network and node
size) with these rates in ``ops`` and ``memory_bandwidth``, ``gemm_flops`` the largest
matmul's rate and ``memory_bytes`` what the device reports. ``--measurements`` writes every
timing beside it. The grid holds no shape of a particular model, so a step predicted with the
profile is a prediction, not a fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from megapp.planning.hardware import PROFILES, Hardware, load_hardware
from megapp.planning.microbench import (
    FULL,
    QUICK,
    Sizes,
    Timer,
    attention_rates,
    back_to_back,
    kernel_overheads,
    kernel_rates,
    matmul_grid,
    warm_up,
)
from megapp.planning.op_fit import op_rates
from megapp.planning.operations import OpRates
from megapp.training.flops import gpu_peak

BUILTIN_OF_PART = {"H100 SXM": "h100", "H200 SXM": "h200", "A100 80GB SXM": "a100"}


def base_profile(device_name: str, base: str | None) -> Hardware:
    """``--base``, or the built-in profile of the GPU part ``device_name`` names."""
    if base is not None:
        return load_hardware(base)
    row = gpu_peak(device_name)
    if row is not None and row.part in BUILTIN_OF_PART:
        return PROFILES[BUILTIN_OF_PART[row.part]]
    raise ValueError(
        f"no built-in profile for {device_name!r}; give --base with the profile whose network "
        f"and node size to keep ({', '.join(PROFILES)} or a JSON file)"
    )


def measure(device: torch.device, sizes: Sizes) -> dict:
    """Time the device: every measurement :func:`profile_of` fits."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(device, sizes.repeats)
    warm_up(device)
    properties = torch.cuda.get_device_properties(device) if cuda else None
    device_overhead, launch_overhead = kernel_overheads(timer)
    widths, elements = sizes.kernel_widths, sizes.kernel_elements
    measurements = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "multiprocessors": properties.multi_processor_count if properties else 1,
        "memory_bytes": properties.total_memory if properties else None,
        "kernels": kernel_rates(timer, widths, elements, sizes.buffer, dtype),
        # the same kernels on a sixteenth the elements: their fixed cost per call
        "kernels_small": kernel_rates(timer, widths, elements // 16, elements // 16, dtype),
        "kernel_overhead_s": device_overhead,
        "launch_overhead_s": launch_overhead,
        "matmul": matmul_grid(timer, sizes, dtype),
        "attention": attention_rates(timer, sizes, dtype),
    }
    back_to_back(timer, measurements["matmul"], measurements["attention"], dtype)
    return measurements


def profile_of(measurements: dict, base: Hardware) -> tuple[Hardware, dict]:
    """``base`` with the operation rates fitted to ``measurements`` (and the device's memory
    and peak where it reports them), and how well each part fits."""
    ops, fit = op_rates(measurements)
    row = gpu_peak(measurements["device"])
    hardware = dataclasses.replace(
        base,
        name=f"{base.name} measured on {measurements['device']}",
        gemm_flops=max(r["flops_per_s"] for r in measurements["matmul"]),
        peak_flops=row.dense_16bit_tflops * 1e12 if row is not None else None,
        memory_bytes=float(measurements.get("memory_bytes") or base.memory_bytes),
        memory_bandwidth=ops.memory_bandwidth,
        ops=ops,
    )
    return hardware, fit


def describe(ops: OpRates, fit: dict) -> str:
    """The fitted rates in a few lines, with how well each part fits its timings."""
    matmul = fit["matmul"]
    lines = [
        f"  matmul {ops.matmul_flops / 1e12:.0f} TFLOP/s in full waves of {ops.tile} tiles on "
        f"{ops.multiprocessors} units, +{ops.wave_overhead * 1e6:.1f} us per wave, "
        f"+{ops.matmul_overhead * 1e6:.1f} us per kernel: grid within {matmul['mean_error']:.1%} "
        f"mean, {matmul['max_error']:.1%} worst"
    ]
    if ops.gradient_matmul_flops:
        input_grad, weight_grad = (f / 1e12 for f in ops.gradient_matmul_flops)
        lines.append(
            f"  gradient matmuls: input ({matmul['input_grad_errors']['mean_error']:.1%} mean) "
            f"{input_grad:.0f} TFLOP/s, weight ({matmul['weight_grad_errors']['mean_error']:.1%}"
            f" mean) {weight_grad:.0f} TFLOP/s"
        )
    for a in fit["attention"]:
        lines.append(
            f"  attention, heads of {a['head_dim']}: {a['forward_flops'] / 1e12:.0f} TFLOP/s "
            f"forward (+{a['forward_row_seconds'] * 1e9:.2f} ns per query row, "
            f"+{a['forward_overhead'] * 1e6:.0f} us), {a['backward_flops'] / 1e12:.0f} backward "
            f"(+{a['backward_row_seconds'] * 1e9:.2f} ns per row, "
            f"+{a['backward_overhead'] * 1e6:.0f} us): within "
            f"{a['forward_errors']['max_error']:.1%} and {a['backward_errors']['max_error']:.1%}"
        )
    by_op: dict[str, list[str]] = {}
    fixed = {(op, width): (f, b) for op, width, f, b in ops.kernel_latency}
    for op, width, f, b in ops.kernels:
        at = f" at {width}" if width else ""
        plus = ""
        if (op, width) in fixed:
            plus = " +{:.1f}/{:.1f} us".format(*(t * 1e6 for t in fixed[op, width]))
        by_op.setdefault(op, []).append(f"{f / 1e9:.0f}/{b / 1e9:.0f}{plus}{at}")
    lines.append("  memory-bound GB/s forward/backward (+ fixed us per call):")
    lines += [f"    {op}: {', '.join(cells)}" for op, cells in by_op.items()]
    lines.append(
        f"  per kernel {ops.kernel_overhead * 1e6:.1f} us on the device, "
        f"{ops.launch_overhead * 1e6:.1f} us to launch"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megapp.planning.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda (the current GPU), cuda:N or cpu")
    p.add_argument("--base", help="profile whose network and node size to keep (name or JSON)")
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--measurements", help="where to write every timing (JSON)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--from-measurements", metavar="JSON",
                   help="fit the timings a calibration wrote (--measurements) instead of "
                   "measuring: no device needed (--base names the profile to extend)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.from_measurements:
        print(f"error: --device {args.device}: no CUDA device (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}); run on a GPU machine or give --device cpu",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        if args.from_measurements:
            measurements = json.loads(Path(args.from_measurements).read_text())
        else:
            started = time.perf_counter()
            measurements = measure(device, QUICK if args.quick else FULL)
            measurements["seconds"] = time.perf_counter() - started
        base = base_profile(measurements["device"], args.base)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    hardware, measurements["fit"] = profile_of(measurements, base)
    hardware.save(args.out)
    if args.measurements:
        Path(args.measurements).write_text(json.dumps(measurements, indent=2) + "\n")
    assert hardware.ops is not None
    took = f" in {measurements['seconds']:.0f} s" if "seconds" in measurements else ""
    print(f"{measurements['device']}: calibrated{took} -> {args.out}")
    print(describe(hardware.ops, measurements["fit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
