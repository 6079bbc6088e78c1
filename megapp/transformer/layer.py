"""A pre-norm transformer layer, ``x + attention(norm(x))``, then ``+ mlp(norm(·))``, with its two
sublayers over tensor-parallel ranks.

- :class:`ParallelAttention`: causal self-attention with heads (and key/value groups) split over
  the tensor-parallel ranks;
- :class:`ParallelMLP`: Column(h -> ffn) -> activation -> Row(ffn -> h);
- :class:`TransformerLayer`: the norms, the two sublayers and their fused bias + dropout +
  residual adds.

Each sublayer returns ``(output, bias)`` so that the bias fuses into what follows, and keeps
for backward no tensor it can rebuild from one kept anyway
(:func:`~megapp.autograd.saved.recompute_saved`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megapp import comm
from megapp.autograd.saved import recompute_saved
from megapp.comm import Group
from megapp.context_parallel import attention as cp_attention
from megapp.fusions.bias_ops import bias_dropout_add, bias_gelu, bias_swiglu
from megapp.fusions.norm import LayerNorm
from megapp.fusions.rms_norm import RMSNorm
from megapp.fusions.rope import apply_rotary_pos_emb
from megapp.fusions.softmax import scaled_masked_softmax
from megapp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
)
from megapp.tensor_parallel.random import checkpoint, get_rng_tracker
from megapp.transformer.config import ExpertGroups, TransformerConfig

__all__ = [
    "ParallelAttention",
    "ParallelMLP",
    "TransformerLayer",
    "build_norm",
    "core_attention",
    "merge_heads",
]

# ----- attention -----


def core_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, backend: str
) -> torch.Tensor:
    """Causal softmax(q kᵀ / √d) v on ``[b, heads, s, d]``; k and v may have fewer heads
    (grouped-query attention), each shared by ``heads / groups`` query heads.

    ``sdpa`` is torch's fused attention (no s² tensor kept); ``fused_softmax``
    materializes the scores and runs megapp's scaled masked softmax, which keeps
    only its output (Megatron's path).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
    scores = q.matmul(k.transpose(-1, -2))
    probs = scaled_masked_softmax(scores, None, 1.0 / math.sqrt(q.shape[-1]), True)
    return F.dropout(probs, p=dropout).matmul(v)


def merge_heads(context: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, d]`` -> ``[s, b, heads · d]``."""
    b, heads, s, d = context.shape
    return context.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class ParallelAttention(nn.Module):
    """Self-attention: a column-parallel fused QKV projection, core attention on this
    rank's heads, a row-parallel output projection.

    The QKV weight is laid out group by group (``[q heads of group g; k_g; v_g]``),
    so a column split gives every rank whole query groups with their keys and
    values. Input ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism);
    returns ``(output, output-projection bias)``. With a context-parallel group
    (``cp_group``, ``config.context_parallel_size`` ranks) ``s`` is this rank's slice of
    the sequence and attention reaches the others' keys and values by
    ``config.cp_comm_type`` (:func:`megapp.context_parallel.attention`).
    """

    def __init__(self, config: TransformerConfig, tp_group: Group = None, cp_group: Group = None):
        super().__init__()
        self.config = config
        if comm.world_size(cp_group) != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size is {config.context_parallel_size} but the "
                f"context-parallel group has {comm.world_size(cp_group)} ranks"
            )
        self.cp_group = cp_group if config.context_parallel_size > 1 else None
        # Rebuild the output projection's saved input in backward (off inside full recompute).
        self.recompute_saved_inputs = True
        tp = comm.world_size(tp_group)
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(config, name) % tp:
                raise ValueError(
                    f"{name} ({getattr(config, name)}) is not divisible by the tensor-parallel "
                    f"size ({tp}); choose a tensor-parallel size that divides it"
                )
        # Set during generation (megapp.models.generation): keys and values of earlier tokens.
        self.kv_cache = None
        self.heads_per_rank = config.num_attention_heads // tp
        self.groups_per_rank = config.num_query_groups // tp
        d = config.kv_channels
        init = init_method_normal(config.init_method_std)
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * d
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=init,
            sequence_parallel=config.sequence_parallel,
            tp_comm_overlap=config.tp_comm_overlap,
            tp_group=tp_group,
            params_dtype=config.params_dtype,
        )
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * d,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=init,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
            tp_comm_overlap=config.tp_comm_overlap,
            tp_group=tp_group,
            params_dtype=config.params_dtype,
        )

    def qkv(
        self, x: torch.Tensor, rotary_freqs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's queries, keys and values as ``[b, heads, s, d]``."""
        mixed, _ = self.linear_qkv(x)  # [s, b, groups/tp · (heads/groups + 2) · d]
        s, b, _ = mixed.shape
        d, groups = self.config.kv_channels, self.groups_per_rank
        per_group = self.heads_per_rank // groups
        mixed = mixed.view(s, b, groups, per_group + 2, d)
        q, k, v = mixed.split([per_group, 1, 1], dim=3)
        q = q.reshape(s, b, groups * per_group, d)
        k, v = k.squeeze(3), v.squeeze(3)
        if rotary_freqs is not None:  # [s, 1, 1, rot_dim]
            q = apply_rotary_pos_emb(q, rotary_freqs)
            k = apply_rotary_pos_emb(k, rotary_freqs)
        return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cp_group is not None:  # the config refuses attention dropout here
            return cp_attention(
                q, k, v, group=self.cp_group, comm_type=self.config.cp_comm_type, causal=True
            )
        dropout = self.config.attention_dropout if self.training else 0.0
        # Heads differ per rank, so their dropout masks come from the per-rank stream.
        rng = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with rng:
            return core_attention(q, k, v, dropout, self.config.attention_backend)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return merge_heads(self._attend(q, k, v))

    def forward(
        self, x: torch.Tensor, rotary_freqs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[s, b, h]`` (``[s/tp, b, h]``), ``rotary_freqs`` ``[s, 1, 1, rot_dim]``."""
        if self.kv_cache is not None:
            return self.kv_cache.attend(self, x, rotary_freqs)
        q, k, v = self.qkv(x, rotary_freqs)
        if self.config.recompute_granularity == "selective":
            # Megatron's selective recompute: keep q, k, v; rebuild the attention in backward.
            return self.linear_proj(checkpoint(self._core, q, k, v))
        heads = self._attend(q, k, v)
        context = merge_heads(heads)
        if not self.recompute_saved_inputs:
            return self.linear_proj(context)
        # The projection's saved input is a relayout of the attention output: rebuild it.
        with recompute_saved(context, merge_heads, heads):
            return self.linear_proj(context)


# ----- MLP -----


class ParallelMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with fc1 column- and fc2 row-parallel: one all-reduce
    (or all-gather + reduce-scatter with sequence parallelism) each way.

    Input ``[s, b, h]`` (``[s/tp, b, h]``); returns ``(output, fc2 bias)``: the bias
    is left for the caller to fuse into bias + dropout + residual.
    """

    def __init__(self, config: TransformerConfig, tp_group: Group = None):
        super().__init__()
        self.config = config
        # Rebuild fc2's saved input in backward (turned off inside full recompute).
        self.recompute_saved_inputs = True
        swiglu = config.activation == "swiglu"
        init = init_method_normal(config.init_method_std)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size * (2 if swiglu else 1),
            bias=config.add_bias_linear,
            init_method=init,
            skip_bias_add=True,  # fused into the activation below
            sequence_parallel=config.sequence_parallel,
            tp_comm_overlap=config.tp_comm_overlap,
            tp_group=tp_group,
            params_dtype=config.params_dtype,
            stride=2 if swiglu else 1,  # every rank holds matching gate and up columns
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=init,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
            tp_comm_overlap=config.tp_comm_overlap,
            tp_group=tp_group,
            params_dtype=config.params_dtype,
        )

    def activation(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Fused ops that keep only their pre-activation input for backward."""
        if self.config.activation == "swiglu":
            return bias_swiglu(x, bias)
        if self.config.activation == "gelu_erf":
            return F.gelu(x if bias is None else x + bias)
        if bias is not None:
            return bias_gelu(x, bias)
        return F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        inner, bias = self.linear_fc1(x)
        hidden = self.activation(inner, bias)
        if not self.recompute_saved_inputs:
            return self.linear_fc2(hidden)
        # fc2 would save the activation's output; rebuild it from the kept pre-activation.
        with recompute_saved(hidden, self.activation, inner, bias):
            return self.linear_fc2(hidden)


# ----- the layer -----


def build_moe(config: TransformerConfig, layer_number: int, groups: ExpertGroups) -> nn.Module:
    """The mixture-of-experts MLP of layer ``layer_number``, its parameters marked: the
    experts as expert parallel (reduced over the expert-data-parallel group; an
    expert-tensor-parallel shard as a tensor-parallel one, split like the dense MLP), the
    router and shared expert as sequence parallel when the tokens are split over the
    tensor-parallel ranks."""
    from megapp.moe.layer import MoELayer  # dense models never import the experts
    from megapp.param_attributes import (
        mark_expert_parallel,
        mark_sequence_parallel,
        set_tensor_parallel,
    )

    moe = MoELayer(config.moe_config(), groups.ep, groups.etp, groups.sequence, layer_number)
    etp = config.expert_tensor_parallel_size
    stride = 2 if config.activation == "swiglu" else 1
    experts = moe.experts
    for name, dim, parts in (("fc1", 2, stride), ("fc2", 1, 1), ("fc1_bias", 1, stride)):
        if getattr(experts, name) is not None:
            set_tensor_parallel(getattr(experts, name), dim, parts, etp)
    for param in experts.parameters():
        mark_expert_parallel(param)
    if config.sequence_parallel:
        for module in (moe.router, moe.shared_expert):
            for param in module.parameters() if module is not None else ():
                mark_sequence_parallel(param)
    return moe


def build_norm(config: TransformerConfig) -> nn.Module:
    norm = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return norm(
        config.hidden_size,
        eps=config.layernorm_epsilon,
        sequence_parallel=config.sequence_parallel,
        params_dtype=config.params_dtype,
    )


class TransformerLayer(nn.Module):
    """One layer on ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism).

    With ``config.num_moe_experts`` the MLP of every ``moe_layer_freq``-th layer is a
    mixture of experts (:func:`build_moe`, over ``expert_groups``).

    Each sublayer's output bias, dropout and residual add run as one fused op
    that keeps no mask (it is regenerated from a seed). Each norm's output,
    which the following linear would save, is rebuilt in backward from the
    norm's kept input instead, and the norm keeps that input without its
    per-row statistics, which its backward recomputes (``recompute_saved_inputs``;
    the block turns it off for layers it recomputes whole).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        tp_group: Group = None,
        cp_group: Group = None,
        expert_groups: ExpertGroups | None = None,
    ):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = ParallelAttention(config, tp_group, cp_group)
        self.pre_mlp_layernorm = build_norm(config)
        if config.is_moe_layer(layer_number):
            self.mlp = build_moe(config, layer_number, expert_groups or ExpertGroups())
        else:
            self.mlp = ParallelMLP(config, tp_group)
        self.recompute_saved_inputs = True

    @property
    def recompute_saved_inputs(self) -> bool:
        return self._recompute_saved_inputs

    @recompute_saved_inputs.setter
    def recompute_saved_inputs(self, value: bool) -> None:
        self._recompute_saved_inputs = value
        self.self_attention.recompute_saved_inputs = value
        self.mlp.recompute_saved_inputs = value
        for norm in (self.input_layernorm, self.pre_mlp_layernorm):
            # A memory-efficient norm keeps its output, not the input to recompute from.
            norm.recompute_stats = value and not norm.memory_efficient

    def _sublayer(self, norm, block, x, *extra):
        normed = norm(x)
        if self.recompute_saved_inputs:
            # The forward's own weight and bias: torch.func.functional_call swaps them back
            # before backward rebuilds normed.
            with recompute_saved(normed, norm.normalize, x, norm.weight, norm.bias):
                out, bias = block(normed, *extra)
        else:
            out, bias = block(normed, *extra)
        # With sequence parallelism each rank holds other tokens: draw its own mask.
        own_mask = self.config.sequence_parallel and self.training and self.config.hidden_dropout
        rng = get_rng_tracker().fork() if own_mask else contextlib.nullcontext()
        with rng:
            return bias_dropout_add(out, bias, x, self.config.hidden_dropout, self.training)

    def forward(
        self, hidden_states: torch.Tensor, rotary_freqs: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self._sublayer(self.input_layernorm, self.self_attention, hidden_states, rotary_freqs)
        return self._sublayer(self.pre_mlp_layernorm, self.mlp, x)
