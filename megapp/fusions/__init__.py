"""Fused operators: compiled CPU/CUDA kernels with pure-PyTorch references."""

from megapp.fusions.bias_gelu import (
    BiasGeLUFunction,
    bias_gelu,
    bias_gelu_reference,
    bias_gelu_reference_backward,
)
from megapp.fusions.extension import (
    built_tiers,
    choose_tier,
    cpu_ops_available,
    cuda_ops_available,
    select_tier,
)

__all__ = [
    "BiasGeLUFunction",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_gelu_reference_backward",
    "built_tiers",
    "choose_tier",
    "cpu_ops_available",
    "cuda_ops_available",
    "select_tier",
]
