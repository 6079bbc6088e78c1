"""Operation rates fitted to a device's microbenchmarks (what ``megapp.planning.calibrate``
measures), kept apart from the measuring so that stored measurements can be refitted and
checked on any machine.

- **matmul**: for every candidate tile, a least-squares fit of the grid's seconds to
  ``2·waves·multiprocessors·tm·tn·k' / matmul_flops + waves·wave_overhead +
  matmul_overhead`` (``k'`` the reduction's split-K piece)
  (:meth:`~megapp.planning.operations.OpRates.matmul`), errors weighted relative to each
  measurement, over the forward products; the tile whose model misses them least is kept
  (the first of :data:`TILES` among those that fit alike); under it, the input- and
  weight-gradient layouts' own rates where the grid has them.
- **attention**: forward and backward seconds (single calls) each fitted to
  ``flops / rate + rows · row_seconds + overhead`` (``rows`` the query rows, batch · heads ·
  sequence), per head dimension (flash kernels run slower on narrow heads).
- **memory-bound**: each kernel's forward and backward bandwidth and fixed seconds per call
  through its timings on two sizes (megapp's fused ops in the tier this install runs them:
  norms, bias + GeLU or SwiGLU, bias + dropout + residual, RoPE, the relayout; torch's copy
  and add), the median bandwidth for anything else; the per-kernel device and host
  overheads as measured.

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


def _matmul_terms(r: dict, tile: tuple[int, int], multiprocessors: int) -> list[float]:
    """The multipliers of 1/rate, the per-wave and the per-kernel cost in one product's
    seconds under ``tile``."""
    probe = OpRates(1.0, multiprocessors, tile, 1.0)  # the tiling alone
    waves = probe.waves(r["m"], r["n"], k=r["k"])
    piece = math.ceil(r["k"] / probe.split(r["m"], r["n"], r["k"]))
    return [2.0 * waves * multiprocessors * tile[0] * tile[1] * piece, waves, 1.0]


def fit_matmul(grid: Sequence[dict], multiprocessors: int, bandwidth: float, width: int) -> dict:
    """The tile, rate and overheads whose :meth:`OpRates.matmul` misses the forward products
    of ``grid`` (rows of ``m``, ``n``, ``k``, ``seconds`` and ``layout``, forward where
    absent) least; and, under that tile and those overheads, the rate of the input- and
    weight-gradient products where the grid has them (``gradient_flops``)."""
    best: dict | None = None
    forward = [r for r in grid if r.get("layout", "forward") == "forward"]
    seconds = [r["seconds"] for r in forward]
    for tile in TILES:
        rows = [_matmul_terms(r, tile, multiprocessors) for r in forward]
        inverse_rate, per_wave, per_kernel = relative_least_squares(rows, seconds)
        if inverse_rate <= 0:
            continue
        rates = OpRates(1 / inverse_rate, multiprocessors, tile, bandwidth,
                        wave_overhead=per_wave, matmul_overhead=per_kernel)  # fmt: skip
        predicted = [rates.matmul(r["m"], r["n"], r["k"], width) for r in forward]
        fit = {"tile": tile, "matmul_flops": rates.matmul_flops, "wave_overhead": per_wave,
               "matmul_overhead": per_kernel, **_errors(predicted, seconds)}  # fmt: skip
        # a tile must fit clearly better to replace an earlier (smaller) one: tilings the
        # grid cannot tell apart fit alike to round-off, and round-off must not choose
        if best is None or fit["mean_error"] < best["mean_error"] * (1 - 1e-6):
            best = fit
    if best is None:
        raise ValueError("no tile fits the matmul timings (do they grow with the work?)")
    gradient = []
    for layout in ("input_grad", "weight_grad"):
        rows = [r for r in grid if r.get("layout") == layout]
        if not rows:
            break
        # seconds = work / rate + per_wave · waves + per_kernel, the rate alone refitted:
        # 1/rate minimizing Σ((work/rate + fixed − t) / t)²
        terms = [_matmul_terms(r, best["tile"], multiprocessors) for r in rows]
        fixed = [best["wave_overhead"] * w + best["matmul_overhead"] for _, w, _ in terms]
        scaled = [(work / r["seconds"], 1 - f / r["seconds"])
                  for (work, _, _), f, r in zip(terms, fixed, rows, strict=True)]  # fmt: skip
        rate = sum(a * a for a, _ in scaled) / sum(a * b for a, b in scaled)
        predicted = [work / rate + f for (work, _, _), f in zip(terms, fixed, strict=True)]
        errors = _errors(predicted, [r["seconds"] for r in rows])
        best[f"{layout}_errors"] = errors
        gradient.append(rate)
    if len(gradient) == 2:
        best["gradient_flops"] = tuple(gradient)
    return best


def fit_attention(shapes: Sequence[dict]) -> list[dict]:
    """Forward and backward rates, row costs and overheads of fused causal attention, one
    fit per head dimension among ``shapes`` (rows of ``batch``, ``heads``, ``seq``,
    ``head_dim``, ``forward_s``, ``backward_s``): as many terms as the shapes allow, flops
    first, then rows, then the overhead. The single calls are fitted, not the back-to-back
    timings kept beside them: those moved by up to 19% between two runs on H200s, the
    single calls by at most 5%."""
    fits = []
    for head_dim in sorted({r["head_dim"] for r in shapes}):
        rows = [r for r in shapes if r["head_dim"] == head_dim]
        flops = [2.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * head_dim for r in rows]
        queries = [float(r["batch"] * r["heads"] * r["seq"]) for r in rows]
        terms = min(len(rows), 3)
        columns = [[f, q, 1.0][:terms] for f, q in zip(flops, queries, strict=True)]
        fit: dict = {"head_dim": head_dim}
        for name in ("forward", "backward"):
            measured = [r[f"{name}_s"] for r in rows]
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


def fit_kernels(full: Sequence[dict], small: Sequence[dict]) -> tuple[tuple, tuple]:
    """Each memory-bound kernel's bandwidth and fixed seconds per call, forward and backward,
    from its timings on two sizes (rows of ``op``, ``width``, ``forward`` and ``backward``
    bytes/s and the bytes each call moved): ``seconds = bytes / bandwidth + fixed``
    through both. A kernel measured on one size only (or whose smaller call moved its bytes
    no slower) keeps that size's rate and no fixed cost. Returns the :class:`OpRates`
    ``kernels`` and ``kernel_latency`` rows."""
    smaller = {(r["op"], r["width"]): r for r in small}
    rates, latency = [], []
    for r in full:
        s = smaller.get((r["op"], r["width"]))
        row, fixed = [r["op"], r["width"]], [r["op"], r["width"]]
        for name in ("forward", "backward"):
            bandwidth, seconds = r[name], 0.0
            if s is not None and s.get(f"{name}_bytes", 0) > 0 and s[name] > 0 \
                    and f"{name}_bytes" in r:  # fmt: skip
                big_b, small_b = r[f"{name}_bytes"], s[f"{name}_bytes"]
                big_t, small_t = big_b / r[name], small_b / s[name]
                inverse = (big_t - small_t) / (big_b - small_b) if big_b > small_b else 0.0
                if inverse > 0 and big_t - big_b * inverse > 0:
                    bandwidth, seconds = 1 / inverse, big_t - big_b * inverse
            row.append(bandwidth)
            fixed.append(seconds)
        rates.append(tuple(row))
        if s is not None:
            latency.append(tuple(fixed))
    return tuple(sorted(rates)), tuple(sorted(latency))


def op_rates(measurements: dict) -> tuple[OpRates, dict]:
    """The :class:`OpRates` of a calibration's ``measurements`` and how well each part fits."""
    width = 2 if measurements["dtype"] in ("bfloat16", "float16") else 4
    kernels = measurements["kernels"]  # rows of op, width, forward and backward bytes/s
    bandwidth = statistics.median(k["forward"] for k in kernels)
    units = measurements["multiprocessors"]
    matmul = fit_matmul(measurements["matmul"], units, bandwidth, width)
    attention = fit_attention(measurements["attention"])
    rates, latency = fit_kernels(kernels, measurements.get("kernels_small", ()))
    ops = OpRates(
        matmul_flops=matmul["matmul_flops"],
        multiprocessors=units,
        tile=tuple(matmul["tile"]),
        memory_bandwidth=bandwidth,
        attention=tuple(AttentionRates(**{k: a[k] for k in ATTENTION_KEYS}) for a in attention),
        kernels=rates,
        kernel_latency=latency,
        gradient_matmul_flops=matmul.get("gradient_flops", ()),
        wave_overhead=matmul["wave_overhead"],
        matmul_overhead=matmul["matmul_overhead"],
        kernel_overhead=measurements["kernel_overhead_s"],
        launch_overhead=measurements["launch_overhead_s"],
    )
    return ops, {"matmul": matmul, "attention": attention}
