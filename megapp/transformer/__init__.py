"""Transformer building blocks over tensor-parallel layers."""

from megapp.transformer.attention import ParallelAttention
from megapp.transformer.config import TransformerConfig
from megapp.transformer.mlp import ParallelMLP

__all__ = ["ParallelAttention", "ParallelMLP", "TransformerConfig"]
