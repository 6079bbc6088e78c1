"""The transformer's shape and behaviour in one validated dataclass (Megatron's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ACTIVATIONS = ("gelu", "swiglu")
_NORMS = ("LayerNorm", "RMSNorm")
_POSITIONS = ("learned_absolute", "rope", "none")
_GRANULARITIES = (None, "selective", "full")
_METHODS = (None, "uniform", "block")
_ATTENTION_BACKENDS = ("sdpa", "fused_softmax")


@dataclass
class TransformerConfig:
    num_layers: int
    """Transformer layers in the whole model (all pipeline stages)."""
    hidden_size: int
    """Width ``h`` of the residual stream."""
    num_attention_heads: int
    """Query heads ``a``; must divide by the tensor-parallel size."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means one per query head."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer; ``None`` means ``4 h``."""
    kv_channels: int | None = None
    """Width of one attention head; ``None`` means ``h / a``."""
    hidden_dropout: float = 0.1
    """Dropout on the attention and MLP outputs before the residual add."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    activation: str = "gelu"
    """MLP activation: ``gelu`` (tanh approximation) or ``swiglu``."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute``, ``rope`` or ``none``."""
    rotary_base: int = 10000
    """Base of the rotary frequencies."""
    attention_backend: str = "sdpa"
    """Core attention: ``sdpa`` (torch's scaled_dot_product_attention) or ``fused_softmax``."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    recompute_granularity: str | None = None
    """``None``, ``selective`` (core attention only) or ``full`` (whole layers)."""
    recompute_method: str | None = None
    """With full recompute: ``uniform`` (groups of layers) or ``block`` (the first layers)."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per group (uniform) or layers recomputed (block)."""
    tensor_model_parallel_size: int = 1
    """Ranks that split every layer; checked against the heads and widths."""
    sequence_parallel: bool = False
    """Split the activations outside the tensor-parallel regions along the sequence."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the parameters."""

    def __post_init__(self) -> None:
        sizes = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups")
        for name in (*sizes, "ffn_hidden_size", "kv_channels", "tensor_model_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set kv_channels or change one of them"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        tp = self.tensor_model_parallel_size
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, name) % tp:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) is not divisible by "
                    f"tensor_model_parallel_size ({tp}); choose a tensor-parallel size that "
                    "divides it"
                )
        for name, value, allowed in (
            ("activation", self.activation, _ACTIVATIONS),
            ("normalization", self.normalization, _NORMS),
            ("position_embedding_type", self.position_embedding_type, _POSITIONS),
            ("recompute_granularity", self.recompute_granularity, _GRANULARITIES),
            ("recompute_method", self.recompute_method, _METHODS),
            ("attention_backend", self.attention_backend, _ATTENTION_BACKENDS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ValueError(
                "recompute_granularity full needs recompute_method uniform|block and "
                "recompute_num_layers N"
            )
        if not full and (self.recompute_method, self.recompute_num_layers) != (None, None):
            raise ValueError(
                "recompute_method and recompute_num_layers only apply with "
                "recompute_granularity full"
            )
        if full and self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
