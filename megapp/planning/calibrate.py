"""Measure one device's operation rates and write its hardware profile.

    python -m megapp.planning.calibrate --device cuda --out h200_measured.json
    python -m megapp.planning.calibrate --device cpu --base h100 --quick --out /tmp/p.json

It times, on the device at hand (CUDA events' worth of synchronization around each run,
warm-up first, the median of several):

- **memory-bound kernels**: a copy, an add, a layer norm and a GeLU over a buffer several
  times the last-level cache; bytes read plus written over time. Their median is the
  profile's ``memory_bandwidth``;
- **kernel overhead**: a stream of tiny adds, seconds per kernel;
- **matmuls** of a grid of shapes (16-bit on a GPU, fp32 on a CPU). For each candidate tile,
  the rate of full waves (:meth:`~megapp.planning.operations.OpRates.fitted_matmul_flops`)
  is the median over the grid; the tile whose model misses the grid least is kept;
- **fused attention** (``torch.nn.functional.scaled_dot_product_attention``, causal) forward
  and backward at a few sequence lengths: ``attention_flops`` and the backward's ratio.

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
from megapp.planning.operations import OpRates
from megapp.training.flops import gpu_peak

TILES = ((64, 64), (128, 64), (128, 128), (128, 256), (256, 128))
BUILTIN_OF_PART = {"H100 SXM": "h100", "H200 SXM": "h200", "A100 80GB SXM": "a100"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What to time: buffer elements, matmul grid, attention shapes, repeats."""

    buffer: int
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    attention: tuple[tuple[int, int, int, int], ...]  # (batch, heads, seq, head dim)
    repeats: int


FULL = Sizes(
    buffer=2**28,  # 512 MiB in 16-bit: many times any L2
    rows=(4096, 16384),
    widths=(1024, 4096, 12288),
    attention=((2, 32, 1024, 128), (1, 32, 4096, 128), (1, 16, 8192, 128)),
    repeats=20,
)
QUICK = Sizes(
    buffer=2**22,
    rows=(64, 256),
    widths=(64, 192),
    attention=((1, 2, 128, 32), (1, 2, 256, 32)),
    repeats=3,
)


class Timer:
    """Median seconds of a callable on ``device``: warmed up, then run in loops of enough
    calls to span a few milliseconds (a single short kernel is below the clock's reach)."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        inner = min(1000, max(1, int(2e-3 / max(time.perf_counter() - start, 1e-7))))
        times = []
        for _ in range(self.repeats):
            self.sync()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            times.append((time.perf_counter() - start) / inner)
        return statistics.median(times)


def memory_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> dict[str, float]:
    """Bytes/s (read + written) of four memory-bound kernels."""
    n, device = sizes.buffer, timer.device
    x = torch.randn(n, device=device, dtype=dtype)
    y = torch.randn(n, device=device, dtype=dtype)
    out = torch.empty_like(x)
    w = x.element_size()
    rows = x.view(-1, 4096) if n % 4096 == 0 else x.view(1, -1)
    weight = torch.ones(rows.shape[-1], device=device, dtype=dtype)
    kernels = {
        "copy": (lambda: out.copy_(x), 2 * n * w),
        "add": (lambda: torch.add(x, y, out=out), 3 * n * w),
        "layer_norm": (lambda: F.layer_norm(rows, rows.shape[-1:], weight), 2 * n * w),
        "gelu": (lambda: F.gelu(x), 2 * n * w),
    }
    return {name: nbytes / timer(fn) for name, (fn, nbytes) in kernels.items()}


def kernel_overhead(timer: Timer) -> float:
    """Seconds per kernel of a stream of adds on a one-element tensor. On a GPU the stream is
    queued behind a long matmul and timed with events, so it measures the device's time per
    kernel (run plus gap), not the host's launch rate."""
    x = torch.zeros(1, device=timer.device)
    count = 500
    if timer.device.type != "cuda":

        def stream() -> None:
            for _ in range(count):
                x.add_(1.0)

        return timer(stream) / count
    big = torch.randn(8192, 8192, device=timer.device, dtype=torch.bfloat16)
    samples = []
    for _ in range(timer.repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        big @ big  # keeps the device busy while the host queues the stream
        begin.record()
        for _ in range(count):
            x.add_(1.0)
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3 / count)
    return statistics.median(samples)


def matmul_grid(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Measured FLOP/s of ``[m, k] × [k, n]`` over the grid's shapes."""
    out = []
    for m in sizes.rows:
        for n in sizes.widths:
            for k in sizes.widths:
                a = torch.randn(m, k, device=timer.device, dtype=dtype)
                b = torch.randn(k, n, device=timer.device, dtype=dtype)
                seconds = timer(lambda a=a, b=b: a @ b)
                out.append({"m": m, "n": n, "k": k, "seconds": seconds})
                out[-1]["flops_per_s"] = 2.0 * m * n * k / seconds
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
        forward = timer(
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(o)
        backward = timer(lambda o=o, g=grad: o.backward(g, retain_graph=True))
        flops = 2.0 * b * heads * s * s * d
        out.append({"batch": b, "heads": heads, "seq": s, "head_dim": d, "forward_s": forward,
                    "backward_s": backward, "flops_per_s": flops / forward})  # fmt: skip
    return out


def fit_tile(grid: list[dict], multiprocessors: int, memory_bandwidth: float, width: int) -> dict:
    """The tile and full-wave rate whose :meth:`OpRates.matmul` misses the grid least
    (mean |model/measured − 1|)."""
    best = None
    for tile in TILES:
        probe = OpRates(1.0, multiprocessors, tile, 1.0, 1.0, memory_bandwidth)
        fitted = [probe.fitted_matmul_flops(r["flops_per_s"], r["m"], r["n"], r["k"]) for r in grid]
        rates = dataclasses.replace(probe, matmul_flops=statistics.median(fitted))
        errors = [abs(rates.matmul(r["m"], r["n"], r["k"], width) / r["seconds"] - 1) for r in grid]
        mean = sum(errors) / len(errors)
        if best is None or mean < best["mean_error"]:
            best = {"tile": tile, "matmul_flops": rates.matmul_flops, "mean_error": mean,
                    "max_error": max(errors)}  # fmt: skip
    assert best is not None
    return best


def base_profile(device: torch.device, base: str | None) -> Hardware:
    """``--base``, or the built-in profile of this GPU part."""
    if base is not None:
        return load_hardware(base)
    if device.type == "cuda":
        row = gpu_peak(torch.cuda.get_device_name(device))
        if row is not None and row.part in BUILTIN_OF_PART:
            return PROFILES[BUILTIN_OF_PART[row.part]]
    raise ValueError(
        "no built-in profile for this device; give --base with the profile whose network and "
        f"node size to keep ({', '.join(PROFILES)} or a JSON file)"
    )


def calibrate(device: torch.device, sizes: Sizes, base: Hardware) -> tuple[Hardware, dict]:
    """Time the device and return its profile and every measurement."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(device, sizes.repeats)
    width = torch.empty((), dtype=dtype).element_size()
    memory = memory_rates(timer, sizes, dtype)
    bandwidth = statistics.median(memory.values())
    overhead = kernel_overhead(timer)
    grid = matmul_grid(timer, sizes, dtype)
    units = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    fit = fit_tile(grid, units, bandwidth, width)
    attention = attention_rates(timer, sizes, dtype)
    longest = max(attention, key=lambda r: r["seq"])
    ops = OpRates(
        matmul_flops=fit["matmul_flops"],
        multiprocessors=units,
        tile=fit["tile"],
        attention_flops=longest["flops_per_s"],
        attention_backward_ratio=longest["backward_s"] / longest["forward_s"],
        memory_bandwidth=bandwidth,
        kernel_overhead=overhead,
    )
    memory_bytes = (
        torch.cuda.get_device_properties(device).total_memory if cuda else base.memory_bytes
    )
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    row = gpu_peak(name) if cuda else None
    hardware = dataclasses.replace(
        base,
        name=f"{base.name} measured on {name}",
        gemm_flops=max(r["flops_per_s"] for r in grid),
        peak_flops=row.dense_16bit_tflops * 1e12 if row is not None else None,
        memory_bytes=float(memory_bytes),
        memory_bandwidth=bandwidth,
        ops=ops,
    )
    measurements = {
        "device": name,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "memory_bytes_per_s": memory,
        "kernel_overhead_s": overhead,
        "matmul": grid,
        "matmul_fit": fit,
        "attention": attention,
    }
    return hardware, measurements


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megapp.planning.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda (the current GPU), cuda:N or cpu")
    p.add_argument("--base", help="profile whose network and node size to keep (name or JSON)")
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--measurements", help="where to write every timing (JSON)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device (torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}); run on a GPU machine or give --device cpu",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        base = base_profile(device, args.base)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    hardware, measurements = calibrate(device, QUICK if args.quick else FULL, base)
    measurements["seconds"] = time.perf_counter() - started
    hardware.save(args.out)
    if args.measurements:
        Path(args.measurements).write_text(json.dumps(measurements, indent=2) + "\n")
    ops, fit = hardware.ops, measurements["matmul_fit"]
    assert ops is not None
    print(f"{measurements['device']}: calibrated in {measurements['seconds']:.0f} s -> {args.out}")
    print(f"  matmul {ops.matmul_flops / 1e12:.1f} TFLOP/s per full wave, tile {ops.tile}, "
          f"{ops.multiprocessors} units; grid missed by {fit['mean_error']:.1%} mean, "
          f"{fit['max_error']:.1%} worst")  # fmt: skip
    print(f"  attention {ops.attention_flops / 1e12:.1f} TFLOP/s forward, backward "
          f"{ops.attention_backward_ratio:.2f}x; memory {ops.memory_bandwidth / 1e9:.0f} GB/s; "
          f"{ops.kernel_overhead * 1e6:.1f} us per kernel")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
