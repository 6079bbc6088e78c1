"""Measure one device's operation rates and write its hardware profile.

    python -m megapp.planning.calibrate --device cuda --out h200_measured.json
    python -m megapp.planning.calibrate --device cpu --base h100 --quick --out /tmp/p.json

After 1.5 s of matmuls (the clocks ramp up from idle) it times, on the device at hand
(CUDA events on a GPU; loops of calls spanning a few milliseconds; the median of several):

- **memory-bound kernels**, forward and backward: megapp's fused ops as this install runs
  them (layer and RMS norm, bias + GeLU, bias + SwiGLU, bias + dropout + residual) on 2^26
  elements at widths 1024 to 16384 (their speed depends on it), RoPE, torch's copy and the
  fp32 gradient accumulation over a buffer many times the last-level cache; bytes read plus
  written over time;
- **per-kernel costs**: a stream of tiny adds queued behind a sleeping kernel, so the device
  runs it back to back (seconds per kernel on the device) while the host's time to queue it
  is the launch cost;
- **matmuls** ``F.linear`` over a grid of shapes (16-bit on a GPU, fp32 on a CPU), and
- **fused attention** (``torch.nn.functional.scaled_dot_product_attention``, causal) forward
  and backward at a few shapes and head dimensions, both as single calls after the device
  idled as long (a sleeping kernel): a layer's matmuls alternate with memory-bound work, and
  a device that only multiplies lowers its clocks to stay within its power.

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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megapp.planning.hardware import PROFILES, Hardware, load_hardware
from megapp.planning.op_fit import op_rates
from megapp.planning.operations import OpRates
from megapp.training.flops import gpu_peak

WARM_S = 1.5  # seconds of matmuls before measuring: the clocks ramp up from idle
BUILTIN_OF_PART = {"H100 SXM": "h100", "H200 SXM": "h200", "A100 80GB SXM": "a100"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What to time: buffer elements, matmul grid, attention shapes, repeats."""

    buffer: int  # elements of torch's copy and add
    kernel_elements: int  # of one input of megapp's memory-bound kernels
    kernel_widths: tuple[int, ...]  # their last dimensions
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq, head dim)
    repeats: int


FULL = Sizes(
    buffer=2**28,  # 512 MiB in 16-bit: many times any L2
    kernel_elements=2**26,
    kernel_widths=(1024, 2048, 4096, 8192, 16384),
    rows=(4096, 16384),
    widths=(1024, 4096, 12288),
    attention=(
        (2, 32, 1024, 128), (1, 32, 4096, 128), (1, 16, 8192, 128),
        (2, 32, 1024, 64), (4, 16, 4096, 64), (1, 16, 8192, 64),
    ),
    repeats=20,
)  # fmt: skip
QUICK = Sizes(
    buffer=2**22,
    kernel_elements=2**16,
    kernel_widths=(64, 256),
    rows=(64, 256),
    widths=(64, 192),
    attention=((1, 2, 128, 32), (1, 4, 512, 32)),
    repeats=3,
)


class Timer:
    """Median seconds of a callable on ``device``: warmed up, then run in loops of enough
    calls to span a few milliseconds (a single short kernel is below the clock's reach),
    timed with CUDA events on a GPU."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def loop(self, fn: Callable[[], object], inner: int) -> float:
        """Seconds per call of ``inner`` calls in a row."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) / inner
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / inner

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        self.sync()
        once = self.loop(fn, 1)
        inner = min(1000, max(1, int(2e-3 / max(once, 1e-7))))
        return statistics.median(self.loop(fn, inner) for _ in range(self.repeats))

    def spaced(self, fn: Callable[[], object]) -> float:
        """Median seconds of single calls, each after the device idled (a sleeping kernel)
        about as long: a layer's matmuls alternate with memory-bound kernels, and a device
        that only multiplies slows its clocks to stay within its power."""
        if self.device.type != "cuda":
            return self(fn)
        fn()
        once = self.loop(fn, 1)
        cycles = int(min(once, 0.02) * 1.5e9)  # at about 1.5 GHz
        samples = []
        for _ in range(self.repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        return statistics.median(samples)


def warm_up(device: torch.device) -> None:
    """Run matmuls for :data:`WARM_S` seconds so that the clocks are up before timing."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def kernel_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Forward and backward bytes/s (read + written) of the memory-bound kernels a layer runs,
    one row per kernel and width (the last dimension; 0 where it does not matter): megapp's
    fused ops in the tier this install runs them (compiled, else the reference) on ``[rows,
    width]`` inputs of ``sizes.kernel_elements`` elements at each of ``sizes.widths``, RoPE
    on heads of 128, and torch's copy and fp32 accumulation (``main_grad += grad``)."""
    from megapp import fusions

    device, w = timer.device, torch.empty((), dtype=dtype).itemsize

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    def measure(name: str, width: int, forward, inputs, forward_bytes, backward_bytes) -> dict:
        y = forward()
        grad = torch.randn_like(y)
        backward = timer(
            lambda y=y, g=grad, i=inputs: torch.autograd.grad(y, i, g, retain_graph=True)
        )
        return {"op": name, "width": width, "forward": forward_bytes / timer(forward),
                "backward": backward_bytes / backward}  # fmt: skip

    def at_width(h: int) -> list[dict]:
        n = sizes.kernel_elements // h
        x, residual, wide = leaf(n, h), leaf(n, h), leaf(n, 2 * h)
        weight, bias, bias2 = leaf(h), leaf(h), leaf(2 * h)
        e = n * h  # elements of one [rows, width] tensor
        return [
            measure("layer_norm", h, lambda: fusions.layer_norm(x, weight, bias),
                    (x, weight, bias), 2 * e * w, 3 * e * w),
            measure("rms_norm", h, lambda: fusions.rms_norm(x, weight), (x, weight),
                    2 * e * w, 3 * e * w),
            measure("bias_gelu", h, lambda: fusions.bias_gelu(x, bias), (x, bias),
                    2 * e * w, 3 * e * w),
            measure("bias_swiglu", h, lambda: fusions.bias_swiglu(wide, bias2), (wide, bias2),
                    3 * e * w, 5 * e * w),
            measure("bias_dropout_add", h,
                    lambda: fusions.bias_dropout_add(x, bias, residual, 0.1, True), (x, bias),
                    e * (3 * w + 1), e * (2 * w + 1)),
        ]  # fmt: skip

    rows = [row for h in sizes.kernel_widths for row in at_width(h)]
    d = min(128, sizes.kernel_widths[-1])
    seq = sizes.kernel_elements // (4 * 16 * d)
    rope_in = leaf(seq, 4, 16, d)
    freqs = fusions.rotary_freqs(seq, d, device=device)
    rope_bytes = 2 * rope_in.numel() * w
    rows.append(measure("rope", d, lambda: fusions.apply_rotary_pos_emb(rope_in, freqs),
                        (rope_in,), rope_bytes, rope_bytes))  # fmt: skip
    with torch.no_grad():
        flat = torch.randn(sizes.buffer, device=device, dtype=dtype)
        copy_out, main = torch.empty_like(flat), torch.zeros(sizes.buffer, device=device)
        copy = 2 * sizes.buffer * w / timer(lambda: copy_out.copy_(flat))
        add = sizes.buffer * (w + 8) / timer(lambda: main.add_(flat))
    rows.append({"op": "copy", "width": 0, "forward": copy, "backward": copy})
    rows.append({"op": "add", "width": 0, "forward": add, "backward": add})
    return rows


def kernel_overheads(timer: Timer) -> tuple[float, float]:
    """Seconds per kernel of a stream of adds on a one-element tensor: on the device, and
    for the host to launch it. On a GPU the stream is queued behind a sleeping kernel, so the
    device runs it back to back and its events time the device alone; the host's time to
    queue it is the launch cost. On a CPU the two are one."""
    x = torch.zeros(1, device=timer.device)
    count = 500

    def stream() -> None:
        for _ in range(count):
            x.add_(1.0)

    if timer.device.type != "cuda":
        seconds = timer(stream) / count
        return seconds, seconds
    device, host = [], []
    for _ in range(timer.repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # about 25 ms: longer than queueing the stream
        begin.record()
        start = time.perf_counter()
        stream()
        host.append((time.perf_counter() - start) / count)
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end) / 1e3 / count)
    return statistics.median(device), statistics.median(host)


def matmul_grid(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Seconds of ``y = x·Wᵀ`` (``F.linear``, as a layer runs it), ``x [m, k]``, ``W [n, k]``,
    over the grid's shapes."""
    out = []
    for m in sizes.rows:
        for n in sizes.widths:
            for k in sizes.widths:
                x = torch.randn(m, k, device=timer.device, dtype=dtype)
                w = torch.randn(n, k, device=timer.device, dtype=dtype)
                seconds = timer.spaced(lambda x=x, w=w: F.linear(x, w))
                out.append({"m": m, "n": n, "k": k, "seconds": seconds,
                            "flops_per_s": 2.0 * m * n * k / seconds})  # fmt: skip
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Forward and backward seconds of causal fused attention at each shape, and the rate
    of its unmasked half's FLOPs."""
    out = []
    for b, heads, s, d in sizes.attention:
        q, k, v = (
            torch.randn(b, heads, s, d, device=timer.device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        forward = timer.spaced(lambda q=q, k=k, v=v: causal_attention(q, k, v))
        o = causal_attention(q, k, v)
        grad = torch.randn_like(o)
        inputs = (q, k, v)
        backward = timer.spaced(
            lambda o=o, g=grad, i=inputs: torch.autograd.grad(o, i, g, retain_graph=True)
        )
        flops = 2.0 * b * heads * s * s * d
        out.append({"batch": b, "heads": heads, "seq": s, "head_dim": d, "forward_s": forward,
                    "backward_s": backward, "flops_per_s": flops / forward})  # fmt: skip
    return out


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
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "multiprocessors": properties.multi_processor_count if properties else 1,
        "memory_bytes": properties.total_memory if properties else None,
        "kernels": kernel_rates(timer, sizes, dtype),
        "kernel_overhead_s": device_overhead,
        "launch_overhead_s": launch_overhead,
        "matmul": matmul_grid(timer, sizes, dtype),
        "attention": attention_rates(timer, sizes, dtype),
    }


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
    for a in fit["attention"]:
        lines.append(
            f"  attention, heads of {a['head_dim']}: {a['forward_flops'] / 1e12:.0f} TFLOP/s "
            f"forward (+{a['forward_overhead'] * 1e6:.0f} us), {a['backward_flops'] / 1e12:.0f} "
            f"backward (+{a['backward_overhead'] * 1e6:.0f} us): within "
            f"{a['forward_errors']['max_error']:.1%} and {a['backward_errors']['max_error']:.1%}"
        )
    by_op: dict[str, list[str]] = {}
    for op, width, f, b in ops.kernels:
        at = f" at {width}" if width else ""
        by_op.setdefault(op, []).append(f"{f / 1e9:.0f}/{b / 1e9:.0f}{at}")
    lines.append("  memory-bound GB/s forward/backward:")
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
