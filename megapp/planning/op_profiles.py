"""Operation rates for the built-in GPU profiles, derived from one measured device.

:data:`H200_MEASURED` is what ``python -m megapp.planning.calibrate --from-measurements
docs/img/h200_calibration.json`` fits to the timings taken on one NVIDIA H200 SXM (torch
2.11, cuBLAS and cuDNN of CUDA 13.0); ``tests/test_planning_operations.py`` refits them
and checks these numbers. The other parts are derived from it, each by a stated rule:

- **memory-bound kernels** at torch's measured copy rate (0.873 of the H200's 4.8 TB/s):
  the runs these profiles are held to use Transformer Engine's and apex's fused kernels,
  which run near copy speed, not megapp's, which a calibrated profile measures; and their
  layers keep the norms' and activations' outputs for backward rather than rebuild them,
  and attend grouped queries without repeating keys and values, unlike megapp's
  (``OpRates.megapp_layers`` off);
- **H100 SXM**: the H200's compute (the same GH100 processor, 132 SMs, the same clocks and
  989 TFLOP/s dense 16-bit peak by the data sheets); memory-bound work at the same fraction
  of its 3.35 TB/s;
- **A100 SXM 80GB**: 108 SMs; matmul and attention rates the H200's fractions of peak
  times the A100's 312 TFLOP/s times :data:`A100_COMPUTE_FIT`; memory-bound work at the
  same fraction of its 2.039 TB/s; the same per-kernel costs.

:data:`A100_COMPUTE_FIT` is the one number here fitted to published runs: on Narayanan
et al. 2021, Table 1 (``python tools/fit_published.py``,
:mod:`megapp.ablation.published_fit`). Every other run of
:mod:`megapp.planning.published_runs` is held out: MT-NLG on the same GPUs, and every H100
run, whose rates take nothing from it.
"""

from __future__ import annotations

import dataclasses

from megapp.planning.operations import AttentionRates, OpRates

H200_MEASURED = OpRates(
    matmul_flops=815.9054e12,
    multiprocessors=132,
    tile=(128, 64),
    memory_bandwidth=3.2327e12,  # the median of megapp's kernels; not used below
    attention=(
        AttentionRates(64, 431.3170e12, 176.2503e12, 12.851e-6, 28.643e-6, 0.0774e-9, 0.5552e-9),
        AttentionRates(128, 575.5604e12, 215.1808e12, 22.185e-6, 72.126e-6, 0.0, 0.3602e-9),
    ),
    gradient_matmul_flops=(807.8489e12, 809.9767e12),
    wave_overhead=0.3633e-6,
    matmul_overhead=4.2723e-6,
    kernel_overhead=1.7721e-6,
    launch_overhead=8.9846e-6,
)
H200_COPY = 4.2769e12  # torch's copy, bytes read + written per second
H200_HBM = 4.8e12

A100_COMPUTE_FIT = 0.900
"""The A100's matmul and attention rates as a share of what the H200's measured shares of
peak give it (1 would be Ampere's tensor cores reaching the same share of peak through
cuBLAS and cuDNN as Hopper's): fitted on Narayanan et al. 2021 by ``python
tools/fit_published.py``, which minimizes those ten runs' mean error (2.8% here; MT-NLG,
held out: 20.8%). The A100's large 16-bit matmuls then run at about 232 TFLOP/s, 74% of
its peak."""

# part: (multiprocessors, dense 16-bit peak over the H200's, HBM bytes/s)
PARTS = {
    "h200": (132, 1.0, 4.8e12),
    "h100": (132, 1.0, 3.35e12),
    "a100": (108, 312 / 989 * A100_COMPUTE_FIT, 2.039e12),
}


def op_rates(part: str) -> OpRates:
    """The derived operation rates of a built-in part (``h100``, ``h200``, ``a100``)."""
    units, compute, hbm = PARTS[part]
    return dataclasses.replace(
        H200_MEASURED.scaled_compute(compute),
        multiprocessors=units,
        kernels=(),
        memory_bandwidth=H200_COPY / H200_HBM * hbm,
        megapp_layers=False,
    )
