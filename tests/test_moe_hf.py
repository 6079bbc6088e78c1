"""The MoE layer against Hugging Face's MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock with
the same weights: outputs, router logits, the load-balancing loss and every gradient.

The gradients are compared without the load-balancing loss (Hugging Face adds it to the
model's loss, not in the block), its value separately. Both compute their router softmax
in float32 whatever the weights' dtype, so the
comparison is in float32: 1e-5 relative / 1e-6 absolute covers float32 round-off through
two matmuls and a softmax of small tensors, while a wrong routing or weight layout
changes values at 1e-2. Hugging Face counts the load fraction without the 1/k of
Megatron-Core's formula: its loss is k times ours (with coefficient 1).
"""

import pytest
import torch

from megapp.moe import MoEConfig, MoELayer

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}
S, B, H, E, K, FFN = 5, 2, 16, 4, 2, 8


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ours(**overrides) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(
        hidden_size=H,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=K,
        moe_router_pre_softmax=True,
        init_method_std=0.3,
        **overrides,
    )
    return MoELayer(config)


def _copy_experts(ours: MoELayer, theirs) -> None:
    """Our ``[E, h, 2f]``, ``[E, f, h]`` (input first) as theirs ``[E, 2f, h]``, ``[E, h, f]``."""
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.fc1.transpose(1, 2))
        theirs.experts.down_proj.copy_(ours.experts.fc2.transpose(1, 2))


def _run(ours: MoELayer, theirs):
    """Both on the same tokens (theirs ``[b, s, h]``, ours ``[s, b, h]``), backward of the same
    function of the output; returns (ours, theirs) outputs as ``[s, b, h]`` and input grads."""
    x = _randn(S, B, H, seed=1)
    grad = _randn(S, B, H, seed=2)
    mine = x.clone().requires_grad_()
    out, _ = ours(mine)
    (out * grad).sum().backward()
    hf = x.transpose(0, 1).contiguous().requires_grad_()
    hf_out = theirs(hf)
    (hf_out * grad.transpose(0, 1)).sum().backward()
    return out, hf_out.transpose(0, 1), mine.grad, hf.grad.transpose(0, 1)


def _check_router_and_loss(ours: MoELayer, theirs) -> None:
    x = _randn(S, B, H, seed=1)
    ours.config.moe_aux_loss_coeff = 1.0
    ours(x)
    # theirs flattens [b, s], ours [s, b]: compare token by token
    hf_logits = theirs.gate(x.transpose(0, 1).reshape(-1, H))[0]
    our_logits = ours.router.logits(x.reshape(-1, H))
    torch.testing.assert_close(
        our_logits.view(S, B, E), hf_logits.view(B, S, E).transpose(0, 1), **TOL
    )
    hf_loss = load_balancing_loss_func((hf_logits,), E, K)
    torch.testing.assert_close(ours.losses["load_balancing_loss"] * K, hf_loss, **TOL)


def test_equals_mixtral_sparse_moe_block():
    from transformers import MixtralConfig

    ours = _ours(moe_router_norm_topk_prob=True)  # Mixtral: softmax, top k, renormalize
    config = MixtralConfig(
        hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K
    )
    theirs = MixtralSparseMoeBlock(config)
    _copy_experts(ours, theirs)
    out, hf_out, grad, hf_grad = _run(ours, theirs)
    torch.testing.assert_close(out, hf_out, **TOL)
    torch.testing.assert_close(grad, hf_grad, **TOL)
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, **TOL)
    torch.testing.assert_close(
        ours.experts.fc1.grad, theirs.experts.gate_up_proj.grad.transpose(1, 2), **TOL
    )
    torch.testing.assert_close(
        ours.experts.fc2.grad, theirs.experts.down_proj.grad.transpose(1, 2), **TOL
    )
    _check_router_and_loss(ours, theirs)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_equals_qwen2_moe_sparse_moe_block(norm_topk_prob):
    from transformers import Qwen2MoeConfig

    shared = 6
    ours = _ours(
        moe_router_norm_topk_prob=norm_topk_prob,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
    )
    config = Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=shared,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
    )
    theirs = Qwen2MoeSparseMoeBlock(config)
    _copy_experts(ours, theirs)
    mine = ours.shared_expert
    with torch.no_grad():
        gate, up = mine.linear_fc1.weight.chunk(2)
        theirs.shared_expert.gate_proj.weight.copy_(gate)
        theirs.shared_expert.up_proj.weight.copy_(up)
        theirs.shared_expert.down_proj.weight.copy_(mine.linear_fc2.weight)
        theirs.shared_expert_gate.weight.copy_(mine.gate_weight)
    out, hf_out, grad, hf_grad = _run(ours, theirs)
    torch.testing.assert_close(out, hf_out, **TOL)
    torch.testing.assert_close(grad, hf_grad, **TOL)
    hf_shared = theirs.shared_expert
    fc1_grad = torch.cat([hf_shared.gate_proj.weight.grad, hf_shared.up_proj.weight.grad])
    torch.testing.assert_close(mine.linear_fc1.weight.grad, fc1_grad, **TOL)
    torch.testing.assert_close(mine.linear_fc2.weight.grad, hf_shared.down_proj.weight.grad, **TOL)
    torch.testing.assert_close(mine.gate_weight.grad, theirs.shared_expert_gate.weight.grad, **TOL)
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, **TOL)
    torch.testing.assert_close(
        ours.experts.fc1.grad, theirs.experts.gate_up_proj.grad.transpose(1, 2), **TOL
    )
    _check_router_and_loss(ours, theirs)
