"""megapp: a Megatron-style hybrid-parallel (DP × TP × PP) training core for PyTorch."""

__version__ = "0.1.0"
