"""The transformer MLP over tensor-parallel ranks: Column(h -> ffn) -> act -> Row(ffn -> h)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapp.fusions.bias_gelu import bias_gelu
from megapp.fusions.bias_swiglu import bias_swiglu
from megapp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
)
from megapp.tensor_parallel.mappings import Group
from megapp.transformer.config import TransformerConfig
from megapp.transformer.recompute import recompute_saved


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
