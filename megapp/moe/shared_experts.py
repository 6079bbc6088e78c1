"""The shared expert: a dense MLP that every token goes through beside its routed experts
(Qwen2-MoE, DeepSeek), its output added to theirs.

``fc2(act(fc1(x)))`` with ``fc1`` ``[F, h]`` (``[gate; up]`` for SwiGLU) and ``fc2`` ``[h, f]``
(``f = moe_shared_expert_intermediate_size``), built from the tensor-parallel linear layers on
one rank. With ``moe_shared_expert_gate`` the output is scaled per token by
``sigmoid(x · w)``, ``w`` ``[1, h]`` (Qwen2-MoE's ``shared_expert_gate``). Like the routed
experts it rebuilds the activation's output in backward rather than keeping it.
"""

from __future__ import annotations

import torch
from torch import nn

from megapp.autograd.saved import recompute_saved
from megapp.moe.config import MoEConfig
from megapp.moe.experts import activation
from megapp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
)

__all__ = ["SharedExpert"]


class SharedExpert(nn.Module):
    """The always-on expert of an MoE layer; tokens ``[T, h]`` -> ``[T, h]``."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.recompute_saved_inputs = True  # off inside full recompute
        width = config.moe_shared_expert_intermediate_size
        swiglu = config.activation == "swiglu"
        init = init_method_normal(config.init_method_std)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            width * (2 if swiglu else 1),
            bias=config.add_bias_linear,
            init_method=init,
            params_dtype=config.params_dtype,
            stride=2 if swiglu else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            width,
            config.hidden_size,
            bias=config.add_bias_linear,
            init_method=init,
            params_dtype=config.params_dtype,
        )
        if config.moe_shared_expert_gate:
            gate = torch.empty(1, config.hidden_size, dtype=torch.float32)
            self.gate_weight = nn.Parameter(init(gate).to(config.params_dtype))
        else:
            self.gate_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner, _ = self.linear_fc1(x)
        hidden = activation(inner, self.config.activation)
        if self.recompute_saved_inputs:  # rebuild fc2's saved input from the pre-activation
            with recompute_saved(hidden, activation, inner, self.config.activation):
                out, _ = self.linear_fc2(hidden)
        else:
            out, _ = self.linear_fc2(hidden)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(x @ self.gate_weight.t())
        return out
