"""A pre-norm transformer layer: x + attention(norm(x)), then + mlp(norm(·))."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megapp.fusions.bias_dropout_add import bias_dropout_add
from megapp.fusions.norm import LayerNorm, RMSNorm
from megapp.tensor_parallel.mappings import Group
from megapp.tensor_parallel.random import get_rng_tracker
from megapp.transformer.attention import ParallelAttention
from megapp.transformer.config import TransformerConfig
from megapp.transformer.mlp import ParallelMLP
from megapp.transformer.recompute import recompute_saved


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

    Each sublayer's output bias, dropout and residual add run as one fused op
    that keeps no mask (it is regenerated from a seed). Each norm's output,
    which the following linear would save, is rebuilt in backward from the
    norm's kept input instead, and the norm keeps that input without its
    per-row statistics, which its backward recomputes (``recompute_saved_inputs``;
    the block turns it off for layers it recomputes whole).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, tp_group: Group = None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = ParallelAttention(config, tp_group)
        self.pre_mlp_layernorm = build_norm(config)
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
