"""Microbenchmarks of the operations a transformer layer runs, on the device at hand: what
:mod:`megapp.planning.calibrate` measures and :mod:`megapp.planning.op_fit` fits.

Each function returns plain rows (seconds or bytes/s with the shapes they were taken at),
timed by :class:`Timer`: CUDA events on a GPU, the median of several. :meth:`Timer.spaced`
times single calls from a cold cache after the device idled as long, as a layer runs its
operations between others, on operands from memory (what the fit uses); calling the timer
times loops of calls spanning a few milliseconds, back to back (kept beside them).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

WARM_S = 1.5  # seconds of matmuls before measuring: the clocks ramp up from idle
FLUSH_BYTES = 256 * 2**20  # many times the last-level cache of any GPU here (H100, H200: 50 MB)
SLEEP_HZ = 2.0e9  # cycles per second of torch.cuda._sleep's count: at or above the clocks


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
        self.flush: torch.Tensor | None = None  # written before each spaced call

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def loop(self, fn: Callable[[], object], inner: int, lead: float = 0.0) -> float:
        """Seconds per call of ``inner`` calls in a row; on a GPU queued behind a sleeping
        kernel of about ``lead`` seconds."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - start) / inner
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead > 0:
            torch.cuda._sleep(int(min(lead, 0.1) * SLEEP_HZ))
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / inner

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median seconds per call on the device: on a GPU each loop is queued behind a
        sleeping kernel that lasts as long as the host takes to queue it, so that the device
        runs the calls back to back even where one call is quicker on the device than
        launching it on the host (a small kernel behind a Python function)."""
        fn()
        self.sync()
        once = self.loop(fn, 1)
        inner = min(1000, max(1, int(2e-3 / max(once, 1e-7))))
        lead = 0.0
        if self.device.type == "cuda":
            start = time.perf_counter()
            self.loop(fn, inner)
            lead = 1.25 * (time.perf_counter() - start)  # the host's time to queue a loop
        return statistics.median(self.loop(fn, inner, lead) for _ in range(self.repeats))

    def spaced(self, fn: Callable[[], object]) -> float:
        """Median seconds of single calls, each from a cold cache (a buffer larger than any
        last-level cache written first: a layer's operands come from memory, not from the
        previous call's cache) and after the device idled (a sleeping kernel) about as long:
        a layer's matmuls alternate with memory-bound kernels, and a device that only
        multiplies slows its clocks to stay within its power."""
        if self.device.type != "cuda":
            return self(fn)
        if self.flush is None:
            self.flush = torch.empty(FLUSH_BYTES // 4, device=self.device)
        fn()
        once = self.loop(fn, 1)
        cycles = int(min(once, 0.02) * 1.5e9)  # at about 1.5 GHz
        samples = []
        for _ in range(self.repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.flush.zero_()
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
    """Bytes/s of ``forward()`` and of its gradient with respect to ``inputs``, single calls
    from a cold cache (:meth:`Timer.spaced`): a layer's memory-bound kernels read what
    earlier kernels wrote to memory, and the time between kernels is priced apart."""
    y = forward()
    grad = torch.randn_like(y)
    backward = timer.spaced(lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True))
    return _row(op, width, forward_bytes, timer.spaced(forward), backward_bytes, backward)


def _row(op: str, width: int, forward_bytes: float, forward_s: float, backward_bytes: float,
         backward_s: float) -> dict:  # fmt: skip
    return {"op": op, "width": width, "forward": forward_bytes / forward_s,
            "backward": backward_bytes / backward_s, "forward_bytes": forward_bytes,
            "backward_bytes": backward_bytes}  # fmt: skip


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


def kernel_rates(
    timer: Timer, widths: tuple[int, ...], elements: int, buffer: int, dtype: torch.dtype
) -> list[dict]:
    """Forward and backward bytes/s (read + written) of the memory-bound kernels a layer runs,
    one row per kernel and width (the last dimension; 0 where it does not matter), with the
    bytes each call moved: the fused ops (:func:`fused_kernel_rates`) on ``elements``
    elements at each of ``widths``, RoPE on heads of 128 and the attention output's relayout
    on as many, and torch's copy and fp32 accumulation (``main_grad += grad``) over
    ``buffer`` elements."""
    from megapp import fusions

    w = torch.empty((), dtype=dtype).itemsize
    rows = fused_kernel_rates(timer, widths, elements, dtype)
    d = min(128, widths[-1])
    seq = max(1, elements // (4 * 16 * d))
    rope_in = _leaf(timer, dtype, seq, 4, 16, d)
    freqs = fusions.rotary_freqs(seq, d, device=timer.device)
    rope_bytes = 2 * rope_in.numel() * w
    rows.append(_measure(timer, "rope", d, lambda: fusions.apply_rotary_pos_emb(rope_in, freqs),
                         (rope_in,), rope_bytes, rope_bytes))  # fmt: skip
    rows += [relayout_rates(timer, elements, dtype, head_dim) for head_dim in (64, 128)]
    with torch.no_grad():
        flat = torch.randn(buffer, device=timer.device, dtype=dtype)
        copy_out, main = torch.empty_like(flat), torch.zeros(buffer, device=timer.device)
        copy_bytes, add_bytes = 2 * buffer * w, buffer * (w + 8)
        copy = timer.spaced(lambda: copy_out.copy_(flat))
        add = timer.spaced(lambda: main.add_(flat))
    rows.append(_row("copy", 0, copy_bytes, copy, copy_bytes, copy))
    rows.append(_row("add", 0, add_bytes, add, add_bytes, add))
    return rows


def relayout_rates(timer: Timer, elements: int, dtype: torch.dtype, head_dim: int) -> dict:
    """Bytes/s of the attention output's relayout: forward ``[b, heads, s, d]`` to ``[s, b,
    heads·d]`` (:func:`megapp.transformer.layer.merge_heads`, a permuting copy), backward its
    gradient back to the attention's layout; ``elements`` elements, 32 heads."""
    from megapp.transformer.layer import merge_heads

    heads = 32
    seq = max(1, elements // (2 * heads * head_dim))
    nbytes = 2 * 2 * heads * seq * head_dim * torch.empty((), dtype=dtype).itemsize
    with torch.no_grad():
        context = torch.randn(2, heads, seq, head_dim, device=timer.device, dtype=dtype)
        grad = torch.randn(seq, 2, heads * head_dim, device=timer.device, dtype=dtype)
        back = grad.view(seq, 2, heads, head_dim).permute(1, 2, 0, 3)
        forward = timer.spaced(lambda: merge_heads(context))
        backward = timer.spaced(lambda: back.contiguous())
    return _row("relayout", head_dim, nbytes, forward, nbytes, backward)


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


MATMUL_PASSES = ("forward", "input_grad", "weight_grad")


def matmul_call(m: int, n: int, k: int, layout: str, device: torch.device, dtype: torch.dtype):
    """A product with output ``[m, n]`` and reduction ``k`` laid out as one pass of a linear
    layer runs it: ``forward`` ``x·Wᵀ`` (``F.linear``, ``x [m, k]``, ``W [n, k]``),
    ``input_grad`` ``dy·W`` (``dy [m, k]``, ``W [k, n]``), ``weight_grad`` ``dyᵀ·x`` (``dy
    [k, m]``, ``x [k, n]``: the reduction runs over the tokens)."""
    if layout == "forward":
        x, w = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((m, k), (n, k)))
        return lambda: F.linear(x, w)
    if layout == "input_grad":
        g, w = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((m, k), (k, n)))
        return lambda: torch.mm(g, w)
    if layout == "weight_grad":
        g, x = (torch.randn(*shape, device=device, dtype=dtype) for shape in ((k, m), (k, n)))
        return lambda: torch.mm(g.t(), x)
    raise ValueError(f"unknown matmul layout {layout!r}; one of {', '.join(MATMUL_PASSES)}")


def matmul_grid(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Seconds of the products with output ``[m, n]`` and reduction ``k`` over the grid's
    shapes, each laid out as each pass of a linear layer runs it (:func:`matmul_call`),
    single calls after the device idled as long (``seconds``, what the fit uses;
    :func:`back_to_back` adds the same back to back)."""
    shapes = [(m, n, k) for m in sizes.rows for n in sizes.widths for k in sizes.widths]
    out = []
    for layout in MATMUL_PASSES:
        for m, n, k in shapes:
            seconds = timer.spaced(matmul_call(m, n, k, layout, timer.device, dtype))
            out.append({"m": m, "n": n, "k": k, "layout": layout, "seconds": seconds,
                        "flops_per_s": 2.0 * m * n * k / seconds})  # fmt: skip
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_calls(b: int, heads: int, s: int, d: int, device: torch.device, dtype: torch.dtype):
    """Forward and backward calls of causal fused attention laid out as a layer makes them:
    ``[b, heads, s, d]`` views of one fused projection's ``[s, b, heads, 3, d]`` output, not
    contiguous tensors of their own (the kernels' speed depends on the strides); the
    backward returns their gradients without scattering them back."""
    mixed = torch.randn(s, b, heads, 3, d, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.permute(1, 2, 0, 3) for t in mixed.unbind(3))
    o = causal_attention(q, k, v)
    grad = torch.randn_like(o)
    return (
        lambda: causal_attention(q, k, v),
        lambda: torch.autograd.grad(o, (q, k, v), grad, retain_graph=True),
    )


def attention_rates(timer: Timer, sizes: Sizes, dtype: torch.dtype) -> list[dict]:
    """Forward and backward seconds of causal fused attention (:func:`attention_calls`) at
    each shape, single calls after the device idled as long, and the rate of its unmasked
    half's FLOPs (:func:`back_to_back` adds the same back to back)."""
    out = []
    for b, heads, s, d in sizes.attention:
        forward, backward = attention_calls(b, heads, s, d, timer.device, dtype)
        seconds = timer.spaced(forward)
        out.append({"batch": b, "heads": heads, "seq": s, "head_dim": d, "forward_s": seconds,
                    "backward_s": timer.spaced(backward),
                    "flops_per_s": 2.0 * b * heads * s * s * d / seconds})  # fmt: skip
    return out


def back_to_back(timer: Timer, matmul: list[dict], attention: list[dict], dtype: torch.dtype):
    """Add to :func:`matmul_grid`'s and :func:`attention_rates`' rows the same calls timed
    back to back (``seconds_loop``; ``forward_loop_s``, ``backward_loop_s``), kept beside
    the single calls: a step runs them between other kernels, on a device neither idle nor
    only multiplying. Taken after every single call: long loops of large matmuls lower the
    clocks, and calls timed after them would inherit it."""
    for row in matmul:
        call = matmul_call(row["m"], row["n"], row["k"], row["layout"], timer.device, dtype)
        row["seconds_loop"] = timer(call)
    for row in attention:
        shape = (row["batch"], row["heads"], row["seq"], row["head_dim"])
        forward, backward = attention_calls(*shape, timer.device, dtype)
        row["forward_loop_s"], row["backward_loop_s"] = timer(forward), timer(backward)
