"""Microbenchmarks of the operations a transformer layer runs, on the device at hand: what
:mod:`megapp.planning.calibrate` measures and :mod:`megapp.planning.op_fit` fits.

Each function returns plain rows (seconds or bytes/s with the shapes they were taken at),
timed by :class:`Timer`: CUDA events on a GPU, loops of calls spanning a few milliseconds,
the median of several; :meth:`Timer.spaced` times single calls after the device idled as
long, as a layer's matmuls run between memory-bound kernels.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

WARM_S = 1.5  # seconds of matmuls before measuring: the clocks ramp up from idle


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
    widths=(1024, 2304, 4096, 12288),  # 2304: partial waves that tell 128- from 256-wide tiles
    attention=(
        (2, 32, 1024, 128), (2, 16, 2048, 128), (1, 32, 4096, 128), (1, 16, 8192, 128),
        (2, 32, 1024, 64), (2, 32, 2048, 64), (4, 16, 4096, 64), (1, 16, 8192, 64),
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


def _leaf(timer: Timer, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=timer.device, dtype=dtype, requires_grad=True)


def _measure(timer: Timer, op: str, width: int, forward, inputs, forward_bytes, backward_bytes):
    """Bytes/s of ``forward()`` and of its gradient with respect to ``inputs``."""
    y = forward()
    grad = torch.randn_like(y)
    backward = timer(lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True))
    return {"op": op, "width": width, "forward": forward_bytes / timer(forward),
            "backward": backward_bytes / backward}  # fmt: skip


def fused_kernel_rates(
    timer: Timer, widths: tuple[int, ...], elements: int, dtype: torch.dtype
) -> list[dict]:
    """Forward and backward bytes/s (read + written) of megapp's fused memory-bound ops in
    the tier this install runs them (compiled, else the reference), one row per op and
    width: norms, bias + GeLU, bias + SwiGLU, bias + dropout + residual on ``[rows, width]``
    inputs of ``elements`` elements."""
    return [row for h in widths for row in _fused_at_width(timer, h, elements, dtype)]


def _fused_at_width(timer: Timer, h: int, elements: int, dtype: torch.dtype) -> list[dict]:
    from megapp import fusions

    w, n = torch.empty((), dtype=dtype).itemsize, elements // h
    x, residual, wide = (_leaf(timer, dtype, n, c) for c in (h, h, 2 * h))
    weight, bias, bias2 = (_leaf(timer, dtype, c) for c in (h, h, 2 * h))
    e = n * h  # elements of one [rows, width] tensor
    return [
        _measure(timer, "layer_norm", h, lambda: fusions.layer_norm(x, weight, bias),
                 (x, weight, bias), 2 * e * w, 3 * e * w),
        _measure(timer, "rms_norm", h, lambda: fusions.rms_norm(x, weight), (x, weight),
                 2 * e * w, 3 * e * w),
        _measure(timer, "bias_gelu", h, lambda: fusions.bias_gelu(x, bias), (x, bias),
                 2 * e * w, 3 * e * w),
        _measure(timer, "bias_swiglu", h, lambda: fusions.bias_swiglu(wide, bias2),
                 (wide, bias2), 3 * e * w, 5 * e * w),
        _measure(timer, "bias_dropout_add", h,
                 lambda: fusions.bias_dropout_add(x, bias, residual, 0.1, True), (x, bias),
                 e * (3 * w + 1), e * (2 * w + 1)),
    ]  # fmt: skip


def kernel_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Forward and backward bytes/s (read + written) of the memory-bound kernels a layer runs,
    one row per kernel and width (the last dimension; 0 where it does not matter): the fused
    ops (:func:`fused_kernel_rates`) on ``sizes.kernel_elements`` elements at each of
    ``sizes.kernel_widths``, RoPE on heads of 128, the attention output's relayout, and
    torch's copy and fp32 accumulation (``main_grad += grad``)."""
    from megapp import fusions

    w = torch.empty((), dtype=dtype).itemsize
    rows = fused_kernel_rates(timer, sizes.kernel_widths, sizes.kernel_elements, dtype)
    d = min(128, sizes.kernel_widths[-1])
    seq = sizes.kernel_elements // (4 * 16 * d)
    rope_in = _leaf(timer, dtype, seq, 4, 16, d)
    freqs = fusions.rotary_freqs(seq, d, device=timer.device)
    rope_bytes = 2 * rope_in.numel() * w
    rows.append(_measure(timer, "rope", d, lambda: fusions.apply_rotary_pos_emb(rope_in, freqs),
                         (rope_in,), rope_bytes, rope_bytes))  # fmt: skip
    rows += [relayout_rates(timer, sizes, dtype, head_dim) for head_dim in (64, 128)]
    with torch.no_grad():
        flat = torch.randn(sizes.buffer, device=timer.device, dtype=dtype)
        copy_out, main = torch.empty_like(flat), torch.zeros(sizes.buffer, device=timer.device)
        copy = 2 * sizes.buffer * w / timer(lambda: copy_out.copy_(flat))
        add = sizes.buffer * (w + 8) / timer(lambda: main.add_(flat))
    rows.append({"op": "copy", "width": 0, "forward": copy, "backward": copy})
    rows.append({"op": "add", "width": 0, "forward": add, "backward": add})
    return rows


def relayout_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype, head_dim: int) -> dict:
    """Bytes/s of the attention output's relayout: forward ``[b, heads, s, d]`` to ``[s, b,
    heads·d]`` (:func:`megapp.transformer.layer.merge_heads`, a permuting copy), backward its
    gradient back to the attention's layout; ``sizes.kernel_elements`` elements, 32 heads."""
    from megapp.transformer.layer import merge_heads

    heads = 32
    seq = max(1, sizes.kernel_elements // (2 * heads * head_dim))
    nbytes = 2 * 2 * heads * seq * head_dim * torch.empty((), dtype=dtype).itemsize
    with torch.no_grad():
        context = torch.randn(2, heads, seq, head_dim, device=timer.device, dtype=dtype)
        grad = torch.randn(seq, 2, heads * head_dim, device=timer.device, dtype=dtype)
        back = grad.view(seq, 2, heads, head_dim).permute(1, 2, 0, 3)
        forward = timer(lambda: merge_heads(context))
        backward = timer(lambda: back.contiguous())
    return {"op": "relayout", "width": head_dim, "forward": nbytes / forward,
            "backward": nbytes / backward}  # fmt: skip


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
    over the grid's shapes: single calls after the device idled as long (``seconds``, what
    the fit uses) and back to back (``seconds_loop``, kept beside them: a step's matmuls run
    between other kernels, on a device neither idle nor only multiplying)."""
    out = []
    for m in sizes.rows:
        for n in sizes.widths:
            for k in sizes.widths:
                x = torch.randn(m, k, device=timer.device, dtype=dtype)
                w = torch.randn(n, k, device=timer.device, dtype=dtype)
                seconds = timer.spaced(lambda x=x, w=w: F.linear(x, w))
                loop = timer(lambda x=x, w=w: F.linear(x, w))
                out.append({"m": m, "n": n, "k": k, "seconds": seconds, "seconds_loop": loop,
                            "flops_per_s": 2.0 * m * n * k / seconds})  # fmt: skip
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Forward and backward seconds of causal fused attention at each shape, and the rate
    of its unmasked half's FLOPs. Queries, keys and values are laid out as a layer makes
    them: ``[b, heads, s, d]`` views of one fused projection's ``[s, b, heads, 3, d]``
    output, not contiguous tensors of their own (the kernels' speed depends on the
    strides); the backward returns their gradients without scattering them back."""
    out = []
    for b, heads, s, d in sizes.attention:
        mixed = torch.randn(s, b, heads, 3, d, device=timer.device, dtype=dtype)
        mixed.requires_grad_(True)
        q, k, v = (t.permute(1, 2, 0, 3) for t in mixed.unbind(3))
        forward = timer.spaced(lambda q=q, k=k, v=v: causal_attention(q, k, v))
        o = causal_attention(q, k, v)
        grad = torch.randn_like(o)
        inputs = (q, k, v)
        backward = timer.spaced(
            lambda o=o, g=grad, i=inputs: torch.autograd.grad(o, i, g, retain_graph=True)
        )
        flops = 2.0 * b * heads * s * s * d
        # back to back as well, kept beside the fitted single calls (a device kept busy
        # may lower its clocks)
        forward_loop = timer(lambda q=q, k=k, v=v: causal_attention(q, k, v))
        backward_loop = timer(
            lambda o=o, g=grad, i=inputs: torch.autograd.grad(o, i, g, retain_graph=True)
        )
        out.append({"batch": b, "heads": heads, "seq": s, "head_dim": d, "forward_s": forward,
                    "backward_s": backward, "flops_per_s": flops / forward,
                    "forward_loop_s": forward_loop, "backward_loop_s": backward_loop})  # fmt: skip
    return out
