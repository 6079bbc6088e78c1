"""Transformer building blocks over tensor-parallel layers and fused ops."""

from megapp.transformer.attention import ParallelAttention
from megapp.transformer.block import TransformerBlock
from megapp.transformer.config import TransformerConfig
from megapp.transformer.layer import TransformerLayer
from megapp.transformer.mlp import ParallelMLP

__all__ = [
    "ParallelAttention",
    "ParallelMLP",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
]
