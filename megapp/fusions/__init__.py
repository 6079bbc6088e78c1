"""Fused operators: compiled CPU/CUDA kernels with pure-PyTorch references.

Each op's autograd Function decides what is kept for backward; the tier
(CUDA kernel, CPU kernel or reference) is a pure choice made per call.
"""

from megapp.fusions.bias_ops import (
    BiasGeLUFunction,
    bias_dropout_add,
    bias_gelu,
    bias_gelu_reference,
    bias_gelu_reference_backward,
    bias_swiglu,
    dropout_mask,
)
from megapp.fusions.extension import (
    built_tiers,
    choose_tier,
    cpu_ops_available,
    cuda_ops_available,
    select_tier,
)
from megapp.fusions.norm import LayerNorm, layer_norm
from megapp.fusions.rms_norm import RMSNorm, rms_norm
from megapp.fusions.rope import apply_rotary_pos_emb, rotary_freqs
from megapp.fusions.softmax import scaled_masked_softmax

__all__ = [
    "BiasGeLUFunction",
    "LayerNorm",
    "RMSNorm",
    "apply_rotary_pos_emb",
    "bias_dropout_add",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_gelu_reference_backward",
    "bias_swiglu",
    "built_tiers",
    "choose_tier",
    "cpu_ops_available",
    "cuda_ops_available",
    "dropout_mask",
    "layer_norm",
    "rms_norm",
    "rotary_freqs",
    "scaled_masked_softmax",
    "select_tier",
]
