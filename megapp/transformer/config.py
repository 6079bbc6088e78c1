"""The transformer's shape and behaviour in one validated dataclass (Megatron's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

_ACTIVATIONS = ("gelu", "gelu_erf", "swiglu")
_NORMS = ("LayerNorm", "RMSNorm")
_POSITIONS = ("learned_absolute", "rope", "none")
_GRANULARITIES = (None, "selective", "full")
_METHODS = (None, "uniform", "block")
_ATTENTION_BACKENDS = ("sdpa", "fused_softmax")
_CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


class ExpertGroups(NamedTuple):
    """The groups a mixture-of-experts layer talks to (``None``: that dimension is 1)."""

    ep: Any = None
    """Ranks holding different experts."""
    etp: Any = None
    """Ranks splitting each expert's matrices."""
    sequence: Any = None
    """Ranks holding the other parts of this rank's sequences (tp × cp when the tokens are
    split over them), over which the load-balancing loss counts tokens."""


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
    """MLP activation: ``gelu`` (tanh approximation, GPT-2's), ``gelu_erf`` (the exact erf
    form) or ``swiglu``."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linear layers."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even without ``add_bias_linear`` (Qwen2)."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    position_embedding_type: str = "learned_absolute"
    """``learned_absolute``, ``rope`` or ``none``."""
    rotary_base: float = 10000
    """Base of the rotary frequencies (Hugging Face's ``rope_theta``)."""
    rotary_percent: float = 1.0
    """Share of each head's channels that RoPE rotates (the first ones); the rest pass."""
    rope_scaling_factor: float | None = None
    """Llama 3.1's RoPE frequency scaling: long wavelengths divided by this factor, short
    ones kept, the band between interpolated. ``None``: no scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 scaling: wavelengths above ``original / low`` are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 scaling: wavelengths below ``original / high`` are kept."""
    rope_original_max_position_embeddings: int = 8192
    """Llama 3.1 scaling: the context length the model was first trained at."""
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
    tp_comm_overlap: bool = False
    """Run each linear layer's sequence-parallel collective against its matmul, cut into
    pieces (:mod:`megapp.tensor_parallel.overlap`)."""
    context_parallel_size: int = 1
    """Ranks that split every sequence (:mod:`megapp.context_parallel`)."""
    cp_comm_type: str = "p2p"
    """How attention reaches the other context-parallel ranks: ``p2p`` (ring),
    ``all_gather`` or ``a2a`` (Ulysses)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the parameters."""
    num_moe_experts: int | None = None
    """Routed experts per mixture-of-experts layer (None: a dense model). Every ``moe_*`` field
    below, and the two expert sizes, are :class:`~megapp.moe.config.MoEConfig`'s, checked
    there (:meth:`moe_config`)."""
    moe_layer_freq: int = 1
    """Every n-th layer is a mixture-of-experts layer (layers ``l`` with ``l % n == 0``)."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of one expert; None: ``ffn_hidden_size``."""
    moe_router_topk: int = 2
    """Experts each token goes to."""
    moe_router_score_function: str = "softmax"
    """``softmax`` or ``sigmoid``."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top k."""
    moe_router_norm_topk_prob: bool = False
    """With ``moe_router_pre_softmax``: the k chosen probabilities divided by their sum
    (Mixtral; Qwen2-MoE's ``norm_topk_prob``)."""
    moe_router_enable_expert_bias: bool = False
    """Sigmoid router: a per-expert bias for choosing experts, moved after each step towards
    balance (DeepSeek-V3's auxiliary-loss-free balancing; a buffer, saved, not trained)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert bias update: ``bias += rate · sign(mean load − load)``."""
    moe_router_force_load_balancing: bool = False
    """For benchmarks: route by random logits, balanced in expectation (the gradient reaches
    the router's logits as if they had routed)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss``, ``seq_aux_loss`` or ``none``."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss (None: none)."""
    moe_expert_capacity_factor: float | None = None
    """None: dropless; otherwise each expert's capacity factor."""
    moe_token_drop_policy: str = "probs"
    """Which pairs past capacity are dropped: ``probs`` or ``position``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert (None: none)."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output scaled per token by ``sigmoid(x · w)`` (Qwen2-MoE)."""
    moe_token_dispatcher_type: str = "alltoall"
    """``alltoall``, ``allgather`` or ``hierarchical``."""
    moe_dispatch_node_size: int | None = None
    """``hierarchical``: expert-parallel ranks per node (None: one node)."""
    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped matmul where torch has it."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts."""
    expert_tensor_parallel_size: int | None = None
    """Ranks that split each expert; None: the tensor-parallel size (Megatron-Core's
    default)."""

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
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_base <= 0:
            raise ValueError(f"rotary_base must be positive, got {self.rotary_base}")
        rope_only = {
            "rotary_percent": self.rotary_percent != 1.0,
            "rope_scaling_factor": self.rope_scaling_factor is not None,
        }
        for name, used in rope_only.items():
            if used and self.position_embedding_type != "rope":
                raise ValueError(f"{name} needs position_embedding_type 'rope'")
        if self.position_embedding_type == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"RoPE rotates {self.rotary_dim} channels per head (kv_channels "
                f"{self.kv_channels} × rotary_percent {self.rotary_percent}); it must be even"
            )
        if self.rope_scaling_factor is not None:
            if self.rope_scaling_factor < 1.0:
                raise ValueError(
                    f"rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}"
                )
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    "rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                    f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
                )
            if self.rope_original_max_position_embeddings < 1:
                raise ValueError("rope_original_max_position_embeddings must be >= 1")
        if self.add_qkv_bias and self.add_bias_linear:
            raise ValueError(
                "add_qkv_bias is for models without biases on the linear layers; this one has "
                "them all"
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError(
                "tp_comm_overlap overlaps sequence parallelism's gathers and scatters: it "
                "needs sequence_parallel (and tensor_model_parallel_size > 1)"
            )
        self._check_context_parallel()
        self._check_experts()

    def _check_experts(self) -> None:
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.num_moe_experts is None:
            if self.expert_model_parallel_size != 1:
                raise ValueError("expert_model_parallel_size > 1 needs num_moe_experts")
            return
        if not isinstance(self.moe_layer_freq, int) or self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be an integer >= 1, got {self.moe_layer_freq}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            # Megatron-Core's rule: each tp rank must route its own, different tokens
            raise ValueError(
                "mixture-of-experts layers with tensor_model_parallel_size > 1 need "
                "sequence_parallel (each tensor-parallel rank routes its own tokens)"
            )
        self.moe_config()  # MoEConfig checks the rest

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (0-based) is a mixture-of-experts layer."""
        return self.num_moe_experts is not None and layer_number % self.moe_layer_freq == 0

    def moe_config(self) -> Any:
        """The :class:`~megapp.moe.config.MoEConfig` of this model's expert layers."""
        from dataclasses import fields

        from megapp.moe.config import MoEConfig  # only mixture-of-experts models import it

        names = {f.name for f in fields(MoEConfig)}
        values = {n: getattr(self, n) for n in names if hasattr(self, n)}
        return MoEConfig(**values)

    def _check_context_parallel(self) -> None:
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        if cp < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {cp}")
        if self.cp_comm_type not in _CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type must be one of {_CP_COMM_TYPES}, got {self.cp_comm_type!r}"
            )
        if cp == 1:
            return
        if self.attention_dropout:
            raise ValueError(
                f"attention_dropout ({self.attention_dropout}) is not supported with "
                "context_parallel_size > 1; set it to 0"
            )
        if self.cp_comm_type == "a2a" and (self.num_attention_heads // tp) % cp:
            raise ValueError(
                f"cp_comm_type 'a2a' splits each tensor-parallel rank's "
                f"{self.num_attention_heads // tp} query heads over context_parallel_size "
                f"({cp}), which does not divide them; use cp_comm_type 'p2p' or 'all_gather'"
            )

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def rope_scaling(self) -> dict[str, float] | None:
        """Llama 3.1's scaling parameters for :func:`megapp.fusions.rope.rotary_freqs`."""
        if self.rope_scaling_factor is None:
            return None
        return {
            "factor": self.rope_scaling_factor,
            "low_freq_factor": self.rope_low_freq_factor,
            "high_freq_factor": self.rope_high_freq_factor,
            "original_max_position_embeddings": self.rope_original_max_position_embeddings,
        }
