"""The one constant of the operation model fitted to published runs: the A100's matmul and
attention rates as a share of what the H200's measured shares of peak give it
(:data:`megapp.planning.op_profiles.A100_COMPUTE_FIT`). The command line of
``tools/fit_published.py``:

    python tools/fit_published.py

It scales the ``a100-ops`` profile's matmul and attention rates by a factor, predicts the
runs of :data:`FIT_SOURCE` (Narayanan et al. 2021, Table 1: ten layouts on 32-3072 A100s)
as ``tools/compare_published.py --ops`` does, and finds the factor that minimizes their
mean ``|predicted / published − 1|`` by golden-section search. It prints the factor the
profile should carry (the profile's own times the best one), the fit's error and the
held-out error of the other A100 runs (Korthikanti et al. 2022, MT-NLG), which no constant
saw. The H100 and H200 profiles take nothing from it: their rates come from one H200's
measurements.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

from megapp.ablation.published import FIT_SOURCE, compare
from megapp.planning.hardware import PROFILES, Hardware
from megapp.planning.op_profiles import A100_COMPUTE_FIT
from megapp.planning.published_runs import RUNS, PublishedRun, source_label

PART = "a100-ops"


def scaled_compute(hardware: Hardware, factor: float) -> Hardware:
    """``hardware`` with its operation rates' matmul and attention rates times ``factor``
    (memory-bound work, overheads and links unchanged)."""
    if hardware.ops is None:
        raise ValueError(f"{hardware.name} has no operation rates to scale")
    return dataclasses.replace(hardware, ops=hardware.ops.scaled_compute(factor))


def mean_error(runs: Sequence[PublishedRun], hardware: Hardware) -> float:
    """Mean ``|predicted / published − 1|`` of ``runs`` on ``hardware``, priced by
    operation, each run's layout filled in as the comparison fills it."""
    ratios = [compare(run, pick=False, ops=True, hardware=hardware).ratio for run in runs]
    if any(r is None for r in ratios):
        raise ValueError("a run's layout is refused: it cannot be fitted")
    return sum(abs(r - 1) for r in ratios) / len(ratios)


def golden_section(
    f: Callable[[float], float], lo: float, hi: float, tol: float
) -> tuple[float, float]:
    """The ``x`` in ``[lo, hi]`` minimizing a unimodal ``f`` to within ``tol``, and
    ``f(x)``."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (c, fc) if fc <= fd else (d, fd)


@dataclasses.dataclass(frozen=True)
class Fit:
    """The best factor over the profile's current rates, the constant that gives it, and
    the mean errors before and after, on the fitted runs and on the held-out ones, and
    how many runs each are (the held-out ones by the authors and year of their source)."""

    factor: float
    constant: float
    fitted_before: float
    fitted_after: float
    held_out_before: float
    held_out_after: float
    fitted_runs: int = 0
    held_out_runs: int = 0
    held_out_sources: tuple[str, ...] = ()


def fit(lo: float = 0.8, hi: float = 1.2, tol: float = 0.002) -> Fit:
    """Fit the A100's compute share on :data:`FIT_SOURCE` (the factor over the built-in
    profile's rates, ``[lo, hi]``, to ``tol``); the other A100 runs are held out."""
    base = PROFILES[PART]
    a100 = [r for r in RUNS if r.gpu.startswith("a100") and r.precision != "fp8"]
    fitted = [r for r in a100 if r.source == FIT_SOURCE]
    held_out = [r for r in a100 if r.source != FIT_SOURCE]
    factor, after = golden_section(
        lambda x: mean_error(fitted, scaled_compute(base, x)), lo, hi, tol
    )
    best = scaled_compute(base, factor)
    return Fit(
        factor=factor,
        constant=A100_COMPUTE_FIT * factor,
        fitted_before=mean_error(fitted, base),
        fitted_after=after,
        held_out_before=mean_error(held_out, base),
        held_out_after=mean_error(held_out, best),
        fitted_runs=len(fitted),
        held_out_runs=len(held_out),
        held_out_sources=tuple(dict.fromkeys(source_label(r.source) for r in held_out)),
    )


def main() -> int:
    result = fit()
    print("`python tools/fit_published.py`\n")
    print(
        f"A100 compute share: best factor {result.factor:.3f} over the profile's "
        f"A100_COMPUTE_FIT = {A100_COMPUTE_FIT}, so the constant is {result.constant:.3f}\n"
        f"fitted on {source_label(FIT_SOURCE)} ({result.fitted_runs} runs): mean "
        f"|pred/pub - 1| {result.fitted_before:.1%} -> {result.fitted_after:.1%}\n"
        f"held out, the other A100 runs ({'; '.join(result.held_out_sources)}, "
        f"{result.held_out_runs} runs): {result.held_out_before:.1%} -> "
        f"{result.held_out_after:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
