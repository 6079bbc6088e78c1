"""Transformer building blocks over tensor-parallel layers and fused ops."""

from megapp.transformer.block import TransformerBlock
from megapp.transformer.config import TransformerConfig
from megapp.transformer.layer import ParallelAttention, ParallelMLP, TransformerLayer

__all__ = [
    "ParallelAttention",
    "ParallelMLP",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
]
