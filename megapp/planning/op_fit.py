"""Operation rates fitted to a device's microbenchmarks (what ``megapp.planning.calibrate``
measures), kept apart from the measuring so that stored measurements can be refitted and
checked on any machine.

- **matmul**: for every candidate tile, a least-squares fit of the grid's seconds to
  ``2·waves·multiprocessors·tm·tn·k' / matmul_flops + waves·wave_overhead +
  matmul_overhead`` (``k'`` the reduction's split-K piece)
  (:meth:`~megapp.planning.operations.OpRates.matmul`), errors weighted relative to each
  measurement; the tile whose model misses the grid least is kept (the first of
  :data:`TILES` among those that fit alike).
- **attention**: forward and backward seconds (back to back where measured) each fitted to
  ``flops / rate + rows · row_seconds + overhead`` (``rows`` the query rows, batch · heads ·
  sequence), per head dimension (flash kernels run slower on narrow heads).
- **memory-bound**: each kernel's forward and backward bandwidth as measured (megapp's fused
  ops in the tier this install runs them: norms, bias + GeLU or SwiGLU, bias + dropout +
  residual, RoPE; torch's copy and add), their median for anything else; the per-kernel
  device and host overheads as measured.

Every coefficient is kept non-negative: a term whose best coefficient is negative is dropped
and the rest refitted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from megapp.planning.operations import AttentionRates, OpRates

ATTENTION_KEYS = ("head_dim", "forward_flops", "backward_flops")
ATTENTION_KEYS += ("forward_overhead", "backward_overhead")
ATTENTION_KEYS += ("forward_row_seconds", "backward_row_seconds")
TILES = ((64, 64), (128, 64), (64, 128), (128, 128), (128, 256), (256, 128))


def relative_least_squares(
    rows: Sequence[Sequence[float]], targets: Sequence[float]
) -> list[float]:
    """Non-negative ``c`` minimizing ``Σ((rows[i]·c − t_i) / t_i)²``."""
    keep = list(range(len(rows[0])))
    while True:
        a = torch.tensor([[row[j] / t for j in keep] for row, t in zip(rows, targets, strict=True)],
                         dtype=torch.float64)  # fmt: skip
        b = torch.ones(len(targets), 1, dtype=torch.float64)
        solution = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
        negative = [j for j, c in zip(keep, solution, strict=True) if c < 0]
        if not negative or len(keep) == 1:
            coefficients = [0.0] * len(rows[0])
            for j, c in zip(keep, solution, strict=True):
                coefficients[j] = max(c, 0.0)
            return coefficients
        keep.remove(negative[0])


def _errors(predicted: Sequence[float], measured: Sequence[float]) -> dict:
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    return {"mean_error": sum(errors) / len(errors), "max_error": max(errors)}


def fit_matmul(grid: Sequence[dict], multiprocessors: int, bandwidth: float, width: int) -> dict:
    """The tile, rate and overheads whose :meth:`OpRates.matmul` misses ``grid`` (rows of
    ``m``, ``n``, ``k``, ``seconds``) least."""
    best: dict | None = None
    seconds = [r["seconds"] for r in grid]
    for tile in TILES:
        probe = OpRates(1.0, multiprocessors, tile, bandwidth)  # the tiling alone
        rows = []
        for r in grid:
            waves = probe.waves(r["m"], r["n"], k=r["k"])
            piece = math.ceil(r["k"] / probe.split(r["m"], r["n"], r["k"]))
            rows.append([2.0 * waves * multiprocessors * tile[0] * tile[1] * piece, waves, 1.0])
        inverse_rate, per_wave, per_kernel = relative_least_squares(rows, seconds)
        if inverse_rate <= 0:
            continue
        rates = OpRates(1 / inverse_rate, multiprocessors, tile, bandwidth,
                        wave_overhead=per_wave, matmul_overhead=per_kernel)  # fmt: skip
        predicted = [rates.matmul(r["m"], r["n"], r["k"], width) for r in grid]
        fit = {"tile": tile, "matmul_flops": rates.matmul_flops, "wave_overhead": per_wave,
               "matmul_overhead": per_kernel, **_errors(predicted, seconds)}  # fmt: skip
        # a tile must fit clearly better to replace an earlier (smaller) one: tilings the
        # grid cannot tell apart fit alike to round-off, and round-off must not choose
        if best is None or fit["mean_error"] < best["mean_error"] * (1 - 1e-6):
            best = fit
    if best is None:
        raise ValueError("no tile fits the matmul timings (do they grow with the work?)")
    return best


def fit_attention(shapes: Sequence[dict]) -> list[dict]:
    """Forward and backward rates, row costs and overheads of fused causal attention, one
    fit per head dimension among ``shapes`` (rows of ``batch``, ``heads``, ``seq``,
    ``head_dim``, ``forward_s``, ``backward_s``, and where measured ``forward_loop_s``,
    ``backward_loop_s``): as many terms as the shapes allow, flops first, then rows, then
    the overhead. The back-to-back timings are fitted where a calibration took them: a
    training step runs attention between other long kernels, not after an idle device, and
    a device kept busy runs attention's backward 5-20% slower than single calls (one
    H200)."""
    fits = []
    for head_dim in sorted({r["head_dim"] for r in shapes}):
        rows = [r for r in shapes if r["head_dim"] == head_dim]
        flops = [2.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * head_dim for r in rows]
        queries = [float(r["batch"] * r["heads"] * r["seq"]) for r in rows]
        terms = min(len(rows), 3)
        columns = [[f, q, 1.0][:terms] for f, q in zip(flops, queries, strict=True)]
        fit: dict = {"head_dim": head_dim}
        for name in ("forward", "backward"):
            measured = [r.get(f"{name}_loop_s", r[f"{name}_s"]) for r in rows]
            coefficients = relative_least_squares(columns, measured)
            if coefficients[0] <= 0:  # timings that do not grow with the work: a rate alone
                coefficients = relative_least_squares([[f] for f in flops], measured)
            per_flop, per_row, overhead = [*coefficients, 0.0, 0.0][:3]
            fit[f"{name}_flops"], fit[f"{name}_overhead"] = 1 / per_flop, overhead
            fit[f"{name}_row_seconds"] = per_row
            predicted = [
                f * per_flop + q * per_row + overhead for f, q in zip(flops, queries, strict=True)
            ]
            fit[f"{name}_errors"] = _errors(predicted, measured)
        fits.append(fit)
    return fits


def op_rates(measurements: dict) -> tuple[OpRates, dict]:
    """The :class:`OpRates` of a calibration's ``measurements`` and how well each part fits."""
    width = 2 if measurements["dtype"] in ("bfloat16", "float16") else 4
    kernels = measurements["kernels"]  # rows of op, width, forward and backward bytes/s
    bandwidth = statistics.median(k["forward"] for k in kernels)
    units = measurements["multiprocessors"]
    matmul = fit_matmul(measurements["matmul"], units, bandwidth, width)
    attention = fit_attention(measurements["attention"])
    rates = OpRates(
        matmul_flops=matmul["matmul_flops"],
        multiprocessors=units,
        tile=tuple(matmul["tile"]),
        memory_bandwidth=bandwidth,
        attention=tuple(AttentionRates(**{k: a[k] for k in ATTENTION_KEYS}) for a in attention),
        kernels=tuple(sorted((k["op"], k["width"], k["forward"], k["backward"]) for k in kernels)),
        wave_overhead=matmul["wave_overhead"],
        matmul_overhead=matmul["matmul_overhead"],
        kernel_overhead=measurements["kernel_overhead_s"],
        launch_overhead=measurements["launch_overhead_s"],
    )
    return rates, {"matmul": matmul, "attention": attention}
