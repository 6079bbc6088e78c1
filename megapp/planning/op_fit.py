"""Operation rates fitted to a device's microbenchmarks (what ``megapp.planning.calibrate``
measures), kept apart from the measuring so that stored measurements can be refitted and
checked on any machine.

- **matmul**: for every candidate tile, a least-squares fit of the grid's seconds to
  ``2·waves·multiprocessors·tm·tn·k / matmul_flops + waves·wave_overhead + matmul_overhead``
  (:meth:`~megapp.planning.operations.OpRates.matmul`), errors weighted relative to each
  measurement; the tile whose model misses the grid least is kept.
- **attention**: forward and backward seconds each fitted to ``flops / rate + overhead``.
- **memory-bound**: the median bandwidth of megapp's fused kernels (norms, bias + GeLU,
  bias + dropout + residual) as this install runs them; the per-kernel device and host
  overheads as measured.

Every coefficient is kept non-negative: a term whose best coefficient is negative is dropped
and the rest refitted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from megapp.planning.operations import OpRates

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
        probe = OpRates(1.0, multiprocessors, tile, bandwidth, 1.0, 1.0)
        rows = []
        for r in grid:
            waves = probe.waves(r["m"], r["n"])
            rows.append([2.0 * waves * multiprocessors * tile[0] * tile[1] * r["k"], waves, 1.0])
        inverse_rate, per_wave, per_kernel = relative_least_squares(rows, seconds)
        if inverse_rate <= 0:
            continue
        rates = OpRates(1 / inverse_rate, multiprocessors, tile, bandwidth, 1.0, 1.0,
                        wave_overhead=per_wave, matmul_overhead=per_kernel)  # fmt: skip
        predicted = [rates.matmul(r["m"], r["n"], r["k"], width) for r in grid]
        fit = {"tile": tile, "matmul_flops": rates.matmul_flops, "wave_overhead": per_wave,
               "matmul_overhead": per_kernel, **_errors(predicted, seconds)}  # fmt: skip
        if best is None or fit["mean_error"] < best["mean_error"]:
            best = fit
    if best is None:
        raise ValueError("no tile fits the matmul timings (do they grow with the work?)")
    return best


def fit_attention(shapes: Sequence[dict]) -> dict:
    """Forward and backward rates and overheads of fused causal attention from ``shapes``
    (rows of ``batch``, ``heads``, ``seq``, ``head_dim``, ``forward_s``, ``backward_s``)."""
    flops = [2.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] for r in shapes]
    out: dict = {}
    for name, key in (("attention", "forward_s"), ("attention_backward", "backward_s")):
        measured = [r[key] for r in shapes]
        rows = [[f, 1.0] if len(shapes) > 1 else [f] for f in flops]
        coefficients = [*relative_least_squares(rows, measured), 0.0]
        if coefficients[0] <= 0:
            raise ValueError(f"{name} timings do not grow with the work")
        out[f"{name}_flops"], out[f"{name}_overhead"] = 1 / coefficients[0], coefficients[1]
        predicted = [f * coefficients[0] + coefficients[1] for f in flops]
        out[f"{name}_errors"] = _errors(predicted, measured)
    return out


def op_rates(measurements: dict) -> tuple[OpRates, dict]:
    """The :class:`OpRates` of a calibration's ``measurements`` and how well each part fits."""
    width = 2 if measurements["dtype"] in ("bfloat16", "float16") else 4
    memory = measurements["memory_bytes_per_s"]  # megapp's own kernels where measured
    bandwidth = statistics.median(memory.get("megapp", memory.get("torch", memory)).values())
    units = measurements["multiprocessors"]
    matmul = fit_matmul(measurements["matmul"], units, bandwidth, width)
    attention = fit_attention(measurements["attention"])
    rates = OpRates(
        matmul_flops=matmul["matmul_flops"],
        multiprocessors=units,
        tile=tuple(matmul["tile"]),
        memory_bandwidth=bandwidth,
        attention_flops=attention["attention_flops"],
        attention_backward_flops=attention["attention_backward_flops"],
        wave_overhead=matmul["wave_overhead"],
        matmul_overhead=matmul["matmul_overhead"],
        attention_overhead=attention["attention_overhead"],
        attention_backward_overhead=attention["attention_backward_overhead"],
        kernel_overhead=measurements["kernel_overhead_s"],
        launch_overhead=measurements.get("launch_overhead_s", 0.0),
    )
    return rates, {"matmul": matmul, "attention": attention}
