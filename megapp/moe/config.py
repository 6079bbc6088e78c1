"""The mixture-of-experts layer's shape and behaviour in one validated dataclass.

Field names follow Megatron-Core's ``TransformerConfig`` (``num_moe_experts``,
``moe_router_topk``, ``moe_aux_loss_coeff``, ...) so that the fields can move into
:class:`megapp.transformer.TransformerConfig` unchanged; the fields it already has
(``hidden_size``, ``activation``, ``add_bias_linear``, ...) keep its names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("gelu", "gelu_erf", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather", "hierarchical")


@dataclass
class MoEConfig:
    hidden_size: int
    """Width ``h`` of the tokens that enter and leave the layer."""
    num_moe_experts: int
    """Routed experts ``E`` in the layer (over all expert-parallel ranks)."""
    moe_ffn_hidden_size: int
    """Inner width ``f`` of one expert (SwiGLU: of its gate, and of its up projection)."""
    moe_router_topk: int = 2
    """Experts ``k`` each token goes to."""
    activation: str = "swiglu"
    """Expert activation: ``gelu`` (tanh approximation), ``gelu_erf`` or ``swiglu``."""
    add_bias_linear: bool = False
    """Biases on the experts' (and shared experts') two linear layers."""
    moe_router_score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (DeepSeek-V3: independent scores, renormalized over the k
    chosen when k > 1)."""
    moe_router_pre_softmax: bool = False
    """Softmax router: ``False`` (Megatron's default) takes the top k logits and a softmax
    over those k; ``True`` takes a softmax over all experts first, then the top k."""
    moe_router_norm_topk_prob: bool = False
    """With ``moe_router_pre_softmax``: divide the k chosen probabilities by their sum
    (Mixtral; Qwen2-MoE's ``norm_topk_prob``). Without it a softmax over k sums to one."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the chosen probabilities by this (DeepSeek's ``routed_scaling_factor``)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for choosing experts only, moved after
    each step towards balance (DeepSeek-V3's auxiliary-loss-free balancing)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert bias update: ``bias += rate · sign(mean load − load)``."""
    moe_router_force_load_balancing: bool = False
    """For benchmarks: route by random normal logits (the tensor-parallel RNG stream, so a
    recomputed forward routes alike) instead of the router's, which balances every expert's
    load in expectation; their gradient reaches the router's logits unchanged (Megatron-Core's
    ``--moe-router-force-load-balancing``)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss`` (Switch/GShard, over this rank's tokens), ``seq_aux_loss`` (the same per
    sequence, averaged over sequences; DeepSeek-V3) or ``none``."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (0: none)."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router z-loss, ``mean(logsumexp(logits)²)`` (None: none)."""
    moe_expert_capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most
    ``ceil(tokens · k / E · factor)`` of this rank's (token, expert) pairs."""
    moe_token_drop_policy: str = "probs"
    """Which pairs past an expert's capacity are dropped: ``probs`` keeps the highest
    probabilities, ``position`` the earliest tokens (ties: the earlier token)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token goes through (None: none)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x · w)`` (Qwen2-MoE's
    ``shared_expert_gate``)."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach other expert-parallel ranks: ``alltoall``, ``allgather`` or
    ``hierarchical`` (once per destination node, then within it:
    :mod:`megapp.moe.hierarchical`)."""
    moe_dispatch_node_size: int | None = None
    """``hierarchical``: expert-parallel ranks per node, consecutive in the group (None, or
    at least the group's size: one node)."""
    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped matmul where torch has one for the dtype and
    shapes (``torch._grouped_mm``); otherwise, or with False, a loop over the experts."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts; must divide ``num_moe_experts``."""
    expert_tensor_parallel_size: int = 1
    """Ranks that split each expert's matrices; must divide ``moe_ffn_hidden_size``."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the parameters (the router's scores are computed in float32 at least)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        for name, value in (
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, value, allowed in (
            ("activation", self.activation, ACTIVATIONS),
            ("moe_router_score_function", self.moe_router_score_function, SCORE_FUNCTIONS),
            ("moe_router_load_balancing_type", self.moe_router_load_balancing_type,
             LOAD_BALANCING_TYPES),
            ("moe_token_drop_policy", self.moe_token_drop_policy, DROP_POLICIES),
            ("moe_token_dispatcher_type", self.moe_token_dispatcher_type, DISPATCHERS),
        ):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk ({self.moe_router_topk}) is larger than num_moe_experts "
                f"({self.num_moe_experts}); a token cannot go to more experts than there are"
            )
        if self.num_moe_experts % ep:
            raise ValueError(
                f"num_moe_experts ({self.num_moe_experts}) is not divisible by "
                f"expert_model_parallel_size ({ep}); every expert-parallel rank holds the same "
                "number of experts"
            )
        node = self.moe_dispatch_node_size
        hierarchical = self.moe_token_dispatcher_type == "hierarchical"
        if node is not None and (not hierarchical or node < 1 or (ep % node and node % ep)):
            raise ValueError(
                f"moe_dispatch_node_size ({node}) applies to the hierarchical dispatcher and "
                f"must divide expert_model_parallel_size ({ep}) or be a multiple of it (a "
                "node holds whole groups); the ranks of a node are consecutive in the group"
            )
        if self.moe_ffn_hidden_size % etp:
            raise ValueError(
                f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) is not divisible by "
                f"expert_tensor_parallel_size ({etp}); every rank holds the same share of an "
                "expert"
            )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(
                "moe_router_enable_expert_bias needs moe_router_score_function 'sigmoid' "
                "(the bias shifts sigmoid scores for choosing experts)"
            )
        if self.moe_router_norm_topk_prob and (
            self.moe_router_score_function != "softmax" or not self.moe_router_pre_softmax
        ):
            raise ValueError(
                "moe_router_norm_topk_prob applies to the softmax router with "
                "moe_router_pre_softmax; the others' chosen probabilities are normalized already"
            )
        factor = self.moe_expert_capacity_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0 or None, got {factor}")
        for name in ("moe_aux_loss_coeff", "moe_router_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ValueError(f"moe_z_loss_coeff must be >= 0 or None, got {self.moe_z_loss_coeff}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 1):
            raise ValueError(
                f"moe_shared_expert_intermediate_size must be an integer >= 1 or None, got "
                f"{shared!r}"
            )
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")

    @property
    def num_local_experts(self) -> int:
        """Experts on each expert-parallel rank."""
        return self.num_moe_experts // self.expert_model_parallel_size

    @property
    def fc1_width(self) -> int:
        """Output width of an expert's first linear layer (``2f`` for SwiGLU's gate and up)."""
        return self.moe_ffn_hidden_size * (2 if self.activation == "swiglu" else 1)
