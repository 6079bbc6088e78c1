"""How ``tools/benchmarks/bench_kernels.py`` runs and times one implementation of an op.

:func:`make_runner` turns an implementation into a zero-argument call of one pass ("fwd": the
training forward, with autograd recording; "fwd+bwd": that and ``torch.autograd.grad`` with a
fixed output gradient). :func:`measure` times several of them in interleaved rounds whose
number adapts to a time budget.

CPU timing (:class:`CpuTimer`) is ``time.perf_counter`` around each call. CUDA timing
(:class:`CudaTimer`) is a pair of ``torch.cuda.Event`` around each call, with the L2 cache
flushed before it and the stream held back by a short ``torch.cuda._sleep`` so that the
host's launch overhead is queued behind the start event and not timed (an implementation that
launches hundreds of small kernels, like the dropout reference, can outrun the sleep: its time
then includes some launch overhead).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kernel_cases import Case, Inputs, tensor_bytes

from megapp.benchmarks.common import cpu_stall_us, interleaved, stall_pct
from megapp.fusions import extension

SLOW_CALL_S = 0.5
SLOW_MIN_REPEATS = 3


@dataclass
class Row:
    """The timed calls of one op, dtype and pass, per implementation."""

    op: str
    dtype: str
    pass_: str
    tier: str
    nbytes: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    stall: float | None = None  # % of the measurement's wall time that some task waited for a CPU

    def median(self, name: str) -> float | None:
        xs = self.samples.get(name)
        return statistics.median(xs) if xs else None

    def gbps(self, name: str) -> float | None:
        t = self.median(name)
        return self.nbytes / t / 1e9 if t else None


def make_runner(
    fn: Callable[[Inputs], torch.Tensor],
    inputs: Inputs,
    grad_names: tuple[str, ...],
    grad_out: torch.Tensor,
    pass_: str,
    fused: bool | None,
) -> Callable[[], object]:
    """A zero-argument call of one implementation for one pass (fused: MEGAPP_FUSED, or None)."""
    diff = [inputs[name] for name in grad_names]
    env = (lambda: extension.fused(fused)) if fused is not None else contextlib.nullcontext

    if pass_ == "fwd":

        def run() -> object:
            with env():
                return fn(inputs)

    else:

        def run() -> object:
            with env():
                out = fn(inputs)
                return torch.autograd.grad(out, diff, grad_out)

    return run


class CpuTimer:
    """Wall time of one call on the CPU."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def __call__(self, run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start


class CudaTimer:
    """GPU time of one call between two CUDA events, the host's launch overhead excluded.

    Before each call: a write of a buffer larger than L2 (so inputs are not served from a warm
    L2), then ``torch.cuda._sleep`` to keep the stream busy while the host enqueues the start
    event, the op's kernels and the end event; the events then bracket GPU work only.
    """

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=self.device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.sleep = getattr(torch.cuda, "_sleep", None)

    def __call__(self, run: Callable[[], object]) -> float:
        torch.cuda.synchronize(self.device)
        self.flush.zero_()
        if self.sleep is not None:
            self.sleep(2_000_000)  # ~1 ms at ~2 GHz: longer than the host needs to launch run()
        self.start.record()
        result = run()
        self.end.record()
        self.end.synchronize()
        del result
        return self.start.elapsed_time(self.end) / 1e3


def measure(
    runs: dict[str, Callable[[], object]],
    timer: Callable[[Callable[[], object]], float],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Seconds per call of each runner, over interleaved rounds (order rotated each round).

    Each runner gets an equal share of ``args.budget_s``: as many timed calls as fit in it, at
    least ``args.min_repeats`` (``SLOW_MIN_REPEATS`` for a call slower than ``SLOW_CALL_S``, such
    as the pure-PyTorch Philox of the dropout reference) and at most ``args.repeats``, estimated
    from the last warm-up call. Runners with calls left go round-robin, so the fast ones that
    are compared with each other are interleaved through all their rounds.
    """
    names = list(runs)
    per_call: dict[str, float] = {}
    for name in names:
        per_call[name] = timer(runs[name])  # the first call may include one-time costs
        for _ in range(args.warmup - 1):
            if per_call[name] > SLOW_CALL_S:
                break
            per_call[name] = timer(runs[name])
    share = args.budget_s / len(names)
    target = {}
    for name, t in per_call.items():
        lo = args.min_repeats if t <= SLOW_CALL_S else min(args.min_repeats, SLOW_MIN_REPEATS)
        target[name] = max(lo, min(args.repeats, int(share / max(t, 1e-9))))
    calls = {name: (lambda run=runs[name]: timer(run)) for name in names}
    gc.collect()
    gc.disable()  # no collection pauses inside a timed call
    try:
        return interleaved(calls, max(target.values()), counts=target)
    finally:
        gc.enable()


def copy_roof_gbps(repeats: int = 31) -> float:
    """GB/s of ``y.copy_(x)`` on 16 MiB fp32 tensors (read + write): the CPU's practical roof."""
    x = torch.randn(4 * 2**20)
    y = torch.empty_like(x)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - start)
    return 2 * tensor_bytes(x) / statistics.median(times[2:]) / 1e9


def implementations(
    case: Case,
    compiled: Callable[[Inputs], torch.Tensor] | None,
    inputs: Inputs,
    grad_out: torch.Tensor,
    pass_: str,
) -> dict[str, Callable[[], object]]:
    """The calls to time for one op, dtype and pass: megapp, its reference, eager and, when
    ``compiled`` (torch.compile of the eager expression) is given and compiles, that too."""
    impls = {
        "megapp": make_runner(case.megapp, inputs, case.grad_inputs, grad_out, pass_, True),
        "reference": make_runner(case.megapp, inputs, case.grad_inputs, grad_out, pass_, False),
        "eager": make_runner(case.eager, inputs, case.grad_inputs, grad_out, pass_, None),
    }
    if compiled is not None:
        impls["compile"] = make_runner(compiled, inputs, case.grad_inputs, grad_out, pass_, None)
        try:  # compile outside the timed rounds (and skip it if it cannot)
            for _ in range(2):
                impls["compile"]()
        except Exception as err:  # any backend failure: report it, go on
            print(f"  torch.compile failed for {case.op}: {err!r:.200}")
            del impls["compile"]
    return impls


def measure_least_disturbed(
    impls: dict[str, Callable[[], object]],
    timer: Callable[[Callable[[], object]], float],
    args: argparse.Namespace,
    retry_spent: float | None,
) -> tuple[dict[str, list[float]], float | None, float]:
    """:func:`measure`, again while other jobs disturbed it (``--max-stall``, ``--retries``).

    ``retry_spent``: seconds the run already spent on repeats (None: never repeat, as on a
    GPU). Returns the least disturbed samples, their stall % (Linux PSI) and the seconds
    spent on repeats here.
    """
    samples, stall, spent = None, None, 0.0
    for attempt in range(1 + args.retries):
        stall_before, started = cpu_stall_us(), time.perf_counter()
        got = measure(impls, timer, args)
        elapsed = time.perf_counter() - started
        got_stall = stall_pct(stall_before, cpu_stall_us(), elapsed)
        if samples is None or (got_stall is not None and got_stall < stall):
            samples, stall = got, got_stall
        # Another try only for a measurement that other jobs disturbed, and only while the
        # whole run's retry budget lasts.
        if retry_spent is None or stall is None or stall <= args.max_stall:
            break
        if attempt == args.retries or retry_spent + spent + elapsed > args.retry_budget_s:
            break
        spent += elapsed
        print(f"  CPU stall {got_stall:.0f}% > {args.max_stall:g}%: measuring again")
    return samples, stall, spent
