"""Fused LayerNorm and RMSNorm over the last dim, with an optional memory-efficient backward.

For x ``[..., h]`` (e.g. ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism) and
parameters ``[h]``::

    LayerNorm: y = (x − mean)·rstd·weight + bias,  rstd = 1/√(Σ(x − mean)²/h + eps)
    RMSNorm:   y = x·rstd·weight,                   rstd = 1/√(Σx²/h + eps)

The math runs in float32 for float32/bf16/fp16 inputs (float64 for float64) and y is returned in
x's dtype. The parameters have x's dtype, or float32 when x is bf16/fp16 (mixed precision, as
Apex's ``MixedFusedLayerNorm``); their gradients come back in the parameters' dtype.

What backward keeps, besides the parameters:

* default: the input x and per-row statistics (mean and rstd for LayerNorm, rstd for RMSNorm) in
  float32 (float64 for float64 x), shaped ``[...]``;
* ``recompute_stats=True``: the input x alone. Backward recomputes the statistics from x with the
  forward's own code (the CPU kernel's ``layer_norm_stats`` / ``rms_norm_stats``, the reference's
  ``*_reference_stats``, the CUDA forward kernel), bit for bit, so the gradients are unchanged; it
  costs one more pass over x, and saves 8 (LayerNorm) or 4 (RMSNorm) bytes per row;
* ``memory_efficient=True`` (Apex's ``memory_efficient``): the output y and rstd. Backward recovers
  ``x̂ = (y − bias)/weight``, so when the next op keeps y anyway (a linear layer saves its input)
  the norm stores no activation of its own. This needs every weight entry nonzero: the compiled
  kernels and the reference turn x̂ into NaN where ``weight == 0``, so such gradients come out NaN
  (caught by loss-scaling / NaN checks) rather than silently wrong, and for CPU parameters, where
  the check costs no device synchronisation, the forward raises ``ValueError`` instead. Entries
  near zero amplify the rounding of y (≈ ulp(y)/|weight| in x̂): keep the default for such weights.

The weight/bias gradients are reduced over fixed row blocks in float32 (float64 for float64) and
the blocks summed in a fixed order, so they are bitwise reproducible.

The implementation is split by mechanism: :mod:`megapp.fusions.layer_norm` and
:mod:`megapp.fusions.rms_norm` (reference, autograd Function, functional and module each) and
:mod:`megapp.fusions.norm_common` (checks and the modules' base). This module gathers their
public names.
"""

from megapp.fusions.layer_norm import (
    LayerNorm,
    LayerNormFunction,
    layer_norm,
    layer_norm_reference,
    layer_norm_reference_backward,
    layer_norm_reference_forward,
    layer_norm_reference_stats,
)
from megapp.fusions.rms_norm import (
    RMSNorm,
    RMSNormFunction,
    rms_norm,
    rms_norm_reference,
    rms_norm_reference_backward,
    rms_norm_reference_forward,
    rms_norm_reference_stats,
)

__all__ = [
    "LayerNorm",
    "LayerNormFunction",
    "RMSNorm",
    "RMSNormFunction",
    "layer_norm",
    "layer_norm_reference",
    "layer_norm_reference_backward",
    "layer_norm_reference_forward",
    "layer_norm_reference_stats",
    "rms_norm",
    "rms_norm_reference",
    "rms_norm_reference_backward",
    "rms_norm_reference_forward",
    "rms_norm_reference_stats",
]
