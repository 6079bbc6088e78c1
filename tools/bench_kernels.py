"""Benchmark megapp's fused ops against their PyTorch reference and the plain eager expression.

    python tools/bench_kernels.py                      # CPU (and CUDA too when a GPU is usable)
    python tools/bench_kernels.py --ops bias_gelu rope --dtypes bf16 --repeats 31
    python tools/bench_kernels.py --device cuda --json /tmp/kernels.json

For each op (bias_gelu, bias_swiglu, bias_dropout_add in training with p = 0.1, causal
scaled_masked_softmax, layer_norm, rms_norm, rope, cross_entropy), dtype (fp32, bf16) and pass
(the training forward alone, and forward + backward) it times three implementations on the same
inputs:

* ``megapp``: the public function (``megapp.fusions.bias_gelu`` ...), i.e. its autograd Function
  calling the compiled kernel of the tensor's device (``torch.ops.megapp.*``);
* ``reference``: the same public function with ``MEGAPP_FUSED=0``, which makes the autograd
  Function run megapp's pure-PyTorch reference forward and backward;
* ``eager``: the plain PyTorch expression a user would write instead (the ``eager`` field of
  each case in ``cases()``: ``F.gelu(x + b, approximate="tanh")``, ``F.layer_norm``,
  ``F.cross_entropy`` ...), with autograd.

With ``--compile`` (on by default on CUDA only) it adds ``compile``: ``torch.compile`` of that
same eager expression, compiled before the timed rounds.

"forward" is the training forward: the inputs require grad and autograd records the graph (the
megapp Functions save what their backward needs). "fwd+bwd" is that forward followed by
``torch.autograd.grad`` with a fixed random output gradient. Every implementation runs once per
round, in an order that rotates from round to round so that background load (other jobs on the
machine) hits all of them alike; each cell is the median over the rounds, and ``IQR%`` is the
interquartile range of megapp's rounds over their median, a measure of the noise. Speedups are
``median(other) / median(megapp)``: above 1 means megapp is faster. The number of rounds adapts
to ``--budget-s`` per (op, dtype, pass) between ``--min-repeats`` and ``--repeats`` (see
``measure``); the default CPU run takes about two minutes on 2 cores. Before timing, each op's
output and input gradients are compared with the reference (max |difference|, same dropout
seed), so the table cannot compare an op with something it does not compute.

Effective bandwidth is the op's minimal memory traffic (every input read once, every output
written once; the counts are printed per op) divided by the median time. On CUDA it is also
given as a fraction of the GPU's HBM peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s, picked from
``torch.cuda.get_device_name``; ``--peak-tbps`` overrides), against a target of 85%.

CPU timing is ``time.perf_counter`` around each call on ``--threads`` torch threads (default: the
cores this process may run on); the header gives the machine, the sources measured (commit,
uncommitted kernel changes), the load and Linux's CPU pressure before and after (other jobs on
the machine), and a copy roof (``y.copy_(x)``, GB/s) to read the CPU bandwidths against. Each
CPU cell records the share of its time some task waited for a CPU ("stall %", Linux PSI: other
jobs); a cell above ``--max-stall`` is measured again (``--retries`` times at most, within
``--retry-budget-s`` for the run) and the least disturbed attempt is kept.

CUDA timing is a pair of ``torch.cuda.Event`` around each call, with the L2 cache flushed before
it and the stream held back by a short ``torch.cuda._sleep`` so that the host's launch overhead
is queued behind the start event and not timed (an implementation that launches hundreds of
small kernels, like the dropout reference, can outrun the sleep: its time then includes some
launch overhead); the GPU shapes are large (0.5-2 GiB per fp32 tensor) so the kernels, not
launch latency or the L2, set the time. Without a usable GPU and megapp._C_cuda the CUDA part is
skipped with a line saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megapp import fusions
from megapp.fusions import extension
from megapp.tensor_parallel import vocab_parallel_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PASSES = ("fwd", "fwd+bwd")
DROPOUT_P = 0.1
EPS = 1e-5
SOFTMAX_SCALE = 0.125  # 1/√64
HBM_TARGET = 0.85
SLOW_CALL_S = 0.5
SLOW_MIN_REPEATS = 3

# Transformer-sized shapes: [s, b, h] activations, [sb, heads, sq, sq] attention scores, RoPE on
# [s, b, heads, d], cross entropy on [s·b, vocab] logits. CPU: quick on 2 cores (16 MiB per fp32
# [s, b, h] tensor; 500 MiB of fp32 logits). CUDA: large enough (0.5-4 GiB per fp32 tensor) that
# the 50 MiB L2 and launch latency do not set the time.
SHAPES = {
    "cpu": dict(s=1024, b=4, h=1024, heads=16, sb=4, sq=512, d=64, vocab=32000),
    "cuda": dict(s=4096, b=8, h=4096, heads=32, sb=4, sq=2048, d=128, vocab=32000),
}


# The ops ------------------------------------------------------------------------------------------

Inputs = dict[str, torch.Tensor]


@dataclass
class Case:
    """One op: how to build its inputs, the three ways to compute it, and its minimal traffic."""

    op: str  # the name megapp.fusions.extension uses (its tier choice and log line)
    shape: str  # for the table header
    traffic: str  # what the byte count counts
    make: Callable[[dict, torch.device, torch.dtype], Inputs]
    megapp: Callable[[Inputs], torch.Tensor]
    eager: Callable[[Inputs], torch.Tensor]
    grad_inputs: tuple[str, ...]  # inputs that require grad (the others are constants)
    nbytes: Callable[[Inputs], tuple[int, int]]  # (forward, backward) minimal bytes
    tier_input: str = "x"  # the tensor whose device and dtype pick the tier


def _nb(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _randn(shape, device, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _make_bias_act(width_mult: int):
    def make(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
        width = width_mult * sh["h"]
        return {
            "x": _randn((sh["s"], sh["b"], width), device, dtype),
            "bias": _randn((width,), device, dtype, 0.1),
        }

    return make


def _gelu_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    # fwd: read x, bias; write y (= x's size). bwd: read dy, x, bias; write dx, dbias.
    return _nb(x, bias) + _nb(x), 3 * _nb(x) + 2 * _nb(bias)


def _swiglu_eager(t: Inputs) -> torch.Tensor:
    gate, up = (t["x"] + t["bias"]).chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    y = _nb(x) // 2  # [..., f] from x [..., 2f]
    # fwd: read x, bias; write y. bwd: read dy, x, bias; write dx, dbias.
    return _nb(x, bias) + y, y + 2 * _nb(x) + 2 * _nb(bias)


def _make_bda(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    shape = (sh["s"], sh["b"], sh["h"])
    return {
        "x": _randn(shape, device, dtype),
        "bias": _randn((sh["h"],), device, dtype, 0.1),
        "residual": _randn(shape, device, dtype),
    }


def _bda_bytes(t: Inputs) -> tuple[int, int]:
    x, bias = t["x"], t["bias"]
    # fwd: read x, residual, bias; write out. bwd: read dout; write dx, dbias (the residual's
    # gradient is dout itself: no traffic). No mask is stored or read (megapp regenerates it).
    return 3 * _nb(x) + _nb(bias), 2 * _nb(x) + _nb(bias)


def _make_softmax(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    sq = sh["sq"]
    return {
        "x": _randn((sh["sb"], sh["heads"], sq, sq), device, dtype, 4.0),
        # A user caches the causal mask; building it is not timed.
        "causal_mask": torch.ones(sq, sq, dtype=torch.bool, device=device).triu(1),
    }


def _softmax_eager(t: Inputs) -> torch.Tensor:
    z = (t["x"] * SOFTMAX_SCALE).masked_fill(t["causal_mask"], float("-inf"))
    return torch.softmax(z, dim=-1)


def _softmax_bytes(t: Inputs) -> tuple[int, int]:
    x = t["x"]
    # Dense count: fwd reads the scores and writes the probabilities (the upper triangle too:
    # it is written as zeros). bwd: read dy, y; write dx.
    return 2 * _nb(x), 3 * _nb(x)


def _make_norm(with_bias: bool):
    def make(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
        h = sh["h"]
        t = {
            "x": _randn((sh["s"], sh["b"], h), device, dtype),
            "weight": (1.0 + _randn((h,), device, torch.float32, 0.1)).to(dtype),
        }
        if with_bias:
            t["bias"] = _randn((h,), device, dtype, 0.1)
        return t

    return make


def _norm_bytes(n_stats: int):
    def nbytes(t: Inputs) -> tuple[int, int]:
        x = t["x"]
        params = [t["weight"]] + ([t["bias"]] if "bias" in t else [])
        stats = n_stats * 4 * (x.numel() // x.shape[-1])  # float32 mean/rstd per row
        # fwd: read x, params; write y, stats. bwd: read dy, x, stats, weight; write dx, and one
        # gradient per parameter.
        fwd = 2 * _nb(x) + _nb(*params) + stats
        bwd = 3 * _nb(x) + stats + _nb(t["weight"]) + _nb(*params)
        return fwd, bwd

    return nbytes


def _make_rope(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    s, d = sh["s"], sh["d"]
    return {
        "x": _randn((s, sh["b"], sh["heads"], d), device, dtype),
        "freqs": fusions.rotary_freqs(s, d, device=device),
    }


def _rope_eager(t: Inputs) -> torch.Tensor:
    # Megatron-LM's _apply_rotary_pos_emb_bshd (non-interleaved), as written there.
    x, freqs = t["x"], t["freqs"]
    rot_dim = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos_, sin_ = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rot = x_rot * cos_ + torch.cat((-x2, x1), dim=-1) * sin_
    return torch.cat((x_rot, x_pass), dim=-1)


def _rope_bytes(t: Inputs) -> tuple[int, int]:
    x, freqs = t["x"], t["freqs"]
    # fwd: read x, freqs; write y. bwd: read dy, freqs; write dx.
    return 2 * _nb(x) + _nb(freqs), 2 * _nb(x) + _nb(freqs)


def _make_cross_entropy(sh: dict, device: torch.device, dtype: torch.dtype) -> Inputs:
    rows, vocab = sh["s"] * sh["b"], sh["vocab"]
    return {
        "x": _randn((rows, vocab), device, dtype, 2.0),
        "target": torch.randint(0, vocab, (rows,), device=device),
    }


def _cross_entropy_bytes(t: Inputs) -> tuple[int, int]:
    x, target = t["x"], t["target"]
    rows = target.numel()
    # fwd: read logits, target; write the float32 loss, m and log Z. bwd: read dloss, logits,
    # target, m, log Z; write dlogits. (megapp's forward reads the logits twice: the max, then
    # the sums after the all-reduce; the count is the minimum.)
    return _nb(x, target) + 12 * rows, 2 * _nb(x) + _nb(target) + 12 * rows


def _rms_eager(t: Inputs) -> torch.Tensor:
    x, w = t["x"], t["weight"]
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def cases(sh: dict) -> list[Case]:
    s, b, h, heads, sb, sq, d = (sh[k] for k in ("s", "b", "h", "heads", "sb", "sq", "d"))
    nh = f"[s={s}, b={b}, h={h}]"
    return [
        Case(
            "bias_gelu",
            f"x {nh}, bias [h]",
            "fwd: x + bias + y; bwd: dy + x + bias + dx + dbias",
            _make_bias_act(1),
            lambda t: fusions.bias_gelu(t["x"], t["bias"]),
            lambda t: F.gelu(t["x"] + t["bias"], approximate="tanh"),
            ("x", "bias"),
            _gelu_bytes,
        ),
        Case(
            "bias_swiglu",
            f"x [s={s}, b={b}, 2f={2 * h}] -> y [s, b, f={h}], bias [2f]",
            "fwd: x + bias + y (y = x/2); bwd: dy + x + bias + dx + dbias",
            _make_bias_act(2),
            lambda t: fusions.bias_swiglu(t["x"], t["bias"]),
            _swiglu_eager,
            ("x", "bias"),
            _swiglu_bytes,
        ),
        Case(
            "bias_dropout_add",
            f"x, residual {nh}, bias [h], p={DROPOUT_P}, training",
            "fwd: x + residual + bias + out; bwd: dout + dx + dbias (no mask)",
            _make_bda,
            lambda t: fusions.bias_dropout_add(t["x"], t["bias"], t["residual"], DROPOUT_P, True),
            lambda t: t["residual"] + F.dropout(t["x"] + t["bias"], DROPOUT_P, training=True),
            ("x", "bias", "residual"),
            _bda_bytes,
        ),
        Case(
            "scaled_masked_softmax",
            f"scores [b={sb}, heads={heads}, sq={sq}, sk={sq}], causal, scale 1/8",
            "fwd: x + y (dense, both triangles); bwd: dy + y + dx",
            _make_softmax,
            lambda t: fusions.scaled_masked_softmax(t["x"], None, SOFTMAX_SCALE, True),
            _softmax_eager,
            ("x",),
            _softmax_bytes,
        ),
        Case(
            "layer_norm",
            f"x {nh}, weight/bias [h] in x's dtype",
            "fwd: x + w + b + y + mean/rstd; bwd: dy + x + mean/rstd + w + dx + dw + db",
            _make_norm(True),
            lambda t: fusions.layer_norm(t["x"], t["weight"], t["bias"], EPS),
            lambda t: F.layer_norm(t["x"], (t["x"].shape[-1],), t["weight"], t["bias"], EPS),
            ("x", "weight", "bias"),
            _norm_bytes(2),
        ),
        Case(
            "rms_norm",
            f"x {nh}, weight [h] in x's dtype",
            "fwd: x + w + y + rstd; bwd: dy + x + rstd + w + dx + dw",
            _make_norm(False),
            lambda t: fusions.rms_norm(t["x"], t["weight"], EPS),
            _rms_eager,
            ("x", "weight"),
            _norm_bytes(1),
        ),
        Case(
            "rope",
            f"x [s={s}, b={b}, heads={heads}, d={d}], freqs [s, 1, 1, {d}] fp32",
            "fwd: x + freqs + y; bwd: dy + freqs + dx",
            _make_rope,
            lambda t: fusions.apply_rotary_pos_emb(t["x"], t["freqs"]),
            _rope_eager,
            ("x",),
            _rope_bytes,
        ),
        Case(
            "cross_entropy",
            f"logits [s·b={s * b}, V={sh['vocab']}], int64 targets, loss per token",
            "fwd: logits + target + loss + m/log Z; bwd: dloss + logits + target + m/log Z + dx",
            _make_cross_entropy,
            lambda t: vocab_parallel_cross_entropy(t["x"], t["target"]),
            lambda t: F.cross_entropy(t["x"], t["target"], reduction="none"),
            ("x",),
            _cross_entropy_bytes,
        ),
    ]


# Running and timing -------------------------------------------------------------------------------


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
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.disable()
    try:
        for r in range(max(target.values())):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                if len(samples[name]) < target[name]:
                    samples[name].append(timer(runs[name]))
    finally:
        gc.enable()
    return samples


def iqr_pct(xs: list[float]) -> float:
    if len(xs) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100.0 * (q3 - q1) / statistics.median(xs)


def max_abs_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        a, b = (a,), (b,)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def check_against_reference(case: Case, inputs: Inputs, grad_out: torch.Tensor) -> str:
    """max |megapp − reference| of the output and input gradients (same dropout seed), and of
    the output against the eager expression, so no column times something else."""
    fn = case.megapp
    if case.op == "bias_dropout_add":  # one fixed seed for both tiers: the masks must agree

        def fn(t: Inputs) -> torch.Tensor:
            return fusions.bias_dropout_add(
                t["x"], t["bias"], t["residual"], DROPOUT_P, True, seed=1234
            )

    diff = [inputs[name] for name in case.grad_inputs]
    results = []
    for fused in (True, False):
        with extension.fused(fused):
            out = fn(inputs)
            grads = torch.autograd.grad(out, diff, grad_out)
        results.append((out.detach(), grads))
    (out_k, grads_k), (out_r, grads_r) = results
    line = f"y {max_abs_diff(out_k, out_r):.2g}, grads {max_abs_diff(grads_k, grads_r):.2g}"
    if case.op != "bias_dropout_add":  # eager dropout draws another mask: nothing to compare
        with torch.no_grad():
            line += f" (eager y {max_abs_diff(out_k, case.eager(inputs)):.2g})"
    return line


@dataclass
class Row:
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


def bench_device(
    device_kind: str, args: argparse.Namespace, peak_tbps: float | None
) -> tuple[list[Row], dict]:
    sh = SHAPES[device_kind]
    timer = CpuTimer() if device_kind == "cpu" else CudaTimer()
    device = timer.device
    use_compile = args.compile == "on" or (args.compile == "auto" and device_kind == "cuda")
    rows: list[Row] = []
    notes: dict[str, dict] = {}
    retry_spent = 0.0
    for case in cases(sh):
        if args.ops and case.op not in args.ops:
            continue
        notes[case.op] = {"shape": case.shape, "traffic": case.traffic, "checks": {}}
        compiled = None
        if use_compile:
            compiled = torch.compile(case.eager, dynamic=False)
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            torch.manual_seed(0)
            inputs = case.make(sh, device, dtype)
            for name in case.grad_inputs:
                inputs[name].requires_grad_(True)
            with torch.no_grad():
                out_shape = case.eager(inputs).shape
            grad_out = _randn(out_shape, device, dtype)
            fwd_bytes, bwd_bytes = case.nbytes(inputs)
            tier = extension.select_tier(case.op, inputs[case.tier_input])
            notes[case.op]["checks"][dname] = check_against_reference(case, inputs, grad_out)
            for pass_ in args.passes:
                impls: dict[str, Callable[[], object]] = {
                    "megapp": make_runner(
                        case.megapp, inputs, case.grad_inputs, grad_out, pass_, True
                    ),
                    "reference": make_runner(
                        case.megapp, inputs, case.grad_inputs, grad_out, pass_, False
                    ),
                    "eager": make_runner(
                        case.eager, inputs, case.grad_inputs, grad_out, pass_, None
                    ),
                }
                if compiled is not None:
                    impls["compile"] = make_runner(
                        compiled, inputs, case.grad_inputs, grad_out, pass_, None
                    )
                    try:  # compile outside the timed rounds (and skip it if it cannot)
                        for _ in range(2):
                            impls["compile"]()
                    except Exception as err:  # any backend failure: report it, go on
                        print(f"  torch.compile failed for {case.op} {dname}: {err!r:.200}")
                        del impls["compile"]
                samples, stall = None, None
                for attempt in range(1 + args.retries):
                    stall_before, started = cpu_stall_us(), time.perf_counter()
                    got = measure(impls, timer, args)
                    elapsed = time.perf_counter() - started
                    got_stall = stall_pct(stall_before, cpu_stall_us(), elapsed)
                    if samples is None or (got_stall is not None and got_stall < stall):
                        samples, stall = got, got_stall
                    # Another try only for a CPU measurement that other jobs disturbed, and
                    # only while the whole run's retry budget lasts.
                    if device_kind != "cpu" or stall is None or stall <= args.max_stall:
                        break
                    if attempt == args.retries or retry_spent + elapsed > args.retry_budget_s:
                        break
                    retry_spent += elapsed
                    print(f"  CPU stall {got_stall:.0f}% > {args.max_stall:g}%: measuring again")
                nbytes = fwd_bytes if pass_ == "fwd" else fwd_bytes + bwd_bytes
                row = Row(case.op, dname, pass_, tier, nbytes, samples, stall)
                rows.append(row)
                print_progress(row)
            del inputs, grad_out
            if device_kind == "cuda":
                torch.cuda.empty_cache()
    return rows, notes


# Output -------------------------------------------------------------------------------------------


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def ratio(row: Row, name: str) -> float | None:
    mine, other = row.median("megapp"), row.median(name)
    return other / mine if mine and other else None


def print_progress(row: Row) -> None:
    parts = [f"{name} {fmt(row.median(name) * 1e3, '.3f')} ms" for name in row.samples]
    print(f"  {row.op:22s} {row.dtype:4s} {row.pass_:8s} " + ", ".join(parts), flush=True)


def table(rows: list[Row], device_kind: str, peak_tbps: float | None) -> str:
    head = ["op", "dtype", "pass", "megapp ms", "GB/s"]
    with_compile = any("compile" in r.samples for r in rows)
    ms = ".3f" if device_kind == "cuda" else ".2f"  # GPU calls take well under a millisecond
    if device_kind == "cuda":
        head += ["% peak"]
    if with_compile:
        head += ["compile ms", "× compile"]
    head += ["reference ms", "× ref", "eager ms", "× eager", "IQR %", "rounds"]
    if device_kind == "cpu":
        head.append("stall %")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r.op,
            r.dtype,
            r.pass_,
            fmt(r.median("megapp") * 1e3, ms),
            fmt(r.gbps("megapp"), ".1f"),
        ]
        if device_kind == "cuda":
            pct = None
            if peak_tbps and r.gbps("megapp"):
                pct = 100.0 * r.gbps("megapp") / (peak_tbps * 1e3)
            flag = "" if pct is None or pct >= 100 * HBM_TARGET else " (<85)"
            cells.append(fmt(pct, ".0f") + flag)
        if with_compile:
            compile_ms = r.median("compile")
            cells += [
                fmt(compile_ms * 1e3 if compile_ms else None, ms),
                fmt(ratio(r, "compile"), ".2f"),
            ]
        cells += [
            fmt(r.median("reference") * 1e3, ms),
            fmt(ratio(r, "reference"), ".2f"),
            fmt(r.median("eager") * 1e3, ms),
            fmt(ratio(r, "eager"), ".2f"),
            fmt(iqr_pct(r.samples["megapp"]), ".0f"),
            str(len(r.samples["megapp"])),
        ]
        if device_kind == "cpu":
            cells.append(fmt(r.stall, ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def source_state() -> str:
    """The commit and any uncommitted change to the kernels' sources, and the _C build time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = ["csrc", "megapp/fusions", "setup.py"]
    try:
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", *paths],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    changed = [line[3:] for line in dirty if line.strip()]
    built = extension._library_path(extension.CPU_EXTENSION)
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(built)))
        if built
        else "not built"
    )
    return (
        f"commit {commit}, uncommitted changes in {', '.join(changed) if changed else 'none'} "
        f"(of {', '.join(paths)}); megapp._C built {when}"
    )


def cpu_stall_us() -> int | None:
    """Linux PSI's cumulative time (µs) during which some runnable task waited for a CPU."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/pressure/cpu") as f:
        return int(f.readline().split("total=")[1])
    return None


def stall_pct(before: int | None, after: int | None, elapsed_s: float) -> float | None:
    """Share of ``elapsed_s`` with a runnable task waiting for a CPU: other jobs' interference."""
    if before is None or after is None or elapsed_s <= 0:
        return None
    return 100.0 * (after - before) / 1e6 / elapsed_s


def cpu_pressure() -> str:
    """Linux PSI: share of time some runnable task waited for a CPU (other jobs' load)."""
    with contextlib.suppress(OSError), open("/proc/pressure/cpu") as f:
        fields = dict(kv.split("=") for kv in f.readline().split()[1:])
        return f"CPU pressure (some) avg10 {fields['avg10']}%, avg60 {fields['avg60']}%"
    return "CPU pressure unavailable"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}; {cpu_pressure()}"


def copy_roof_gbps(repeats: int = 31) -> float:
    """GB/s of ``y.copy_(x)`` on 16 MiB fp32 tensors (read + write): the CPU's practical roof."""
    x = torch.randn(4 * 2**20)
    y = torch.empty_like(x)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - start)
    return 2 * _nb(x) / statistics.median(times[2:]) / 1e9


def hbm_peak_tbps(name: str) -> float | None:
    """HBM bandwidth of a known GPU, TB/s (SXM parts unless the name says otherwise)."""
    n = name.upper()
    if "H200" in n:
        return 4.8
    if "H100" in n:
        if "PCIE" in n:
            return 2.0
        if "NVL" in n:
            return 3.9
        return 3.35
    if "A100" in n:
        return 2.039 if "80GB" in n else 1.555
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=[c.op for c in cases(SHAPES["cpu"])])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CPU, and CUDA as well when a GPU and megapp's CUDA kernels are usable",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch.set_num_threads (default: the cores this process may run on)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--repeats", type=int, default=25, help="at most this many timed rounds")
    parser.add_argument("--min-repeats", type=int, default=7, help="at least this many")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=3.0,
        help="rounds per (op, dtype, pass) are cut to about this many seconds (the default CPU "
        "run takes about 1.5-2 minutes on 2 cores)",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="also time torch.compile of the eager expression (auto: on CUDA only; on CPU it "
        "adds tens of seconds of compilation per op and dtype)",
    )
    parser.add_argument("--peak-tbps", type=float, help="CUDA: HBM peak, TB/s (default: by name)")
    parser.add_argument(
        "--max-stall",
        type=float,
        default=10.0,
        help="CPU: measure a cell again when some task waited for a CPU more than this %% of its "
        "time (Linux PSI: other jobs on the machine); the least disturbed attempt is kept",
    )
    parser.add_argument("--retries", type=int, default=2, help="CPU: at most this many per cell")
    parser.add_argument(
        "--retry-budget-s",
        type=float,
        default=60.0,
        help="CPU: seconds the whole run may spend on such repeats",
    )
    parser.add_argument("--json", help="also write the samples and settings here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    cuda_ok = torch.cuda.is_available() and extension.cuda_ops_available()
    kinds = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and cuda_ok):
        kinds.append("cuda")

    print("command:", shlex.join(["python", *sys.argv]))
    print(
        f"machine: {platform.platform()}; {cpu_model()}; os.cpu_count() {os.cpu_count()}, "
        f"usable cores {len(os.sched_getaffinity(0))}; python {platform.python_version()}; "
        f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
        f"torch.set_num_threads({args.threads}) -> {torch.get_num_threads()} threads"
    )
    tiers = extension.built_tiers()
    isa = (
        f", CPU kernels' vector ISA {torch.ops.megapp.cpu_kernels_isa()}" if "cpu" in tiers else ""
    )
    print(f"megapp compiled tiers: {sorted(tiers) or 'none'}{isa}")
    # The import path says which tree is measured (an installed megapp may live elsewhere).
    print(f"megapp imported from: {os.path.dirname(fusions.__file__)}")
    print(f"source: {source_state()}")
    if args.device == "auto" and not torch.cuda.is_available():
        print("CUDA: not available, skipping the GPU measurements")
    elif args.device != "cpu" and torch.cuda.is_available() and not cuda_ok:
        print(
            "CUDA: a GPU is present but megapp._C_cuda is not built/loaded"
            + ("; skipping the GPU measurements" if args.device == "auto" else "")
        )
    peak = None
    if "cuda" in kinds:
        if not torch.cuda.is_available():
            print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name()
        peak = args.peak_tbps or hbm_peak_tbps(gpu)
        print(
            f"GPU: {gpu}; CUDA {torch.version.cuda}; HBM peak "
            f"{fmt(peak, '.2f')} TB/s (target {HBM_TARGET:.0%} of it)"
        )
    print(f"before: {load_line()}")
    if "cpu" in kinds:
        print(f"CPU copy roof: y.copy_(x), 16 MiB fp32, {copy_roof_gbps():.1f} GB/s (read + write)")

    report: dict = {"command": shlex.join(["python", *sys.argv]), "devices": {}}
    started = time.perf_counter()
    for kind in kinds:
        print(f"\n== {kind}: {SHAPES[kind]} ==")
        rows, notes = bench_device(kind, args, peak)
        print(f"\n### {kind}\n")
        for op, note in notes.items():
            checks = "; ".join(f"{d}: {c}" for d, c in note["checks"].items())
            print(f"- {op}: {note['shape']}. Bytes: {note['traffic']}.")
            print(f"  max|megapp - reference| (and - eager): {checks}")
        print()
        print(table(rows, kind, peak))
        report["devices"][kind] = {
            "shapes": SHAPES[kind],
            "notes": notes,
            "rows": [
                {
                    "op": r.op,
                    "dtype": r.dtype,
                    "pass": r.pass_,
                    "tier": r.tier,
                    "bytes": r.nbytes,
                    "cpu_stall_pct": r.stall,
                    "samples_s": r.samples,
                }
                for r in rows
            ],
        }
        tiers = {r.tier for r in rows}
        if tiers != {kind}:
            print(f"\nnote: megapp ran the {sorted(tiers)} tier(s) here, not only {kind!r}")
    print(f"\nelapsed {time.perf_counter() - started:.0f} s; after: {load_line()}")
    print(
        "× = median(other) / median(megapp): > 1 means megapp is faster. GB/s = minimal bytes "
        "(fwd, or fwd + bwd) / megapp's median time. IQR % = megapp's interquartile range / median."
        " stall % = share of the cell's time some task waited for a CPU (Linux PSI): other jobs;"
        " high values inflate multi-kernel eager/reference times most (each op's threads wait)."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
