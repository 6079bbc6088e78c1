"""GPT training with mixture-of-experts layers against the single-process run.

Every second layer's MLP is a mixture of experts (dropless, top 2 of 4, with the
load-balancing and z losses on). Expert parameters are reduced over the
expert-data-parallel group, the rest over data × context ranks; the auxiliary losses are
scaled as the main loss is. Held, as every layout, to five steps of the single-process
model: each step's loss and gradient norm (so the auxiliary losses' gradients too), step
1's gathered gradients (experts gathered over the expert-parallel ranks), the parameters
at the end (tolerances in tests/support.py).
"""

from __future__ import annotations

import pytest
import torch

from megapp.models import GPTModel
from megapp.testing import distributed
from megapp.training.flops import gpt_training_flops
from tests.support import check_against_reference, gpt_config, train_layout

MOE = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 8,
    "moe_layer_freq": 2,
    "moe_aux_loss_coeff": 1e-2,
    "moe_z_loss_coeff": 1e-3,
}
SP = {"sequence_parallel": True}
FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 2,
}


def case(world, layout, config, *, slow=False, name=""):
    tag = "-".join(f"{k}{v}" for k, v in layout.items()) + (f"-{name}" if name else "")
    marks = pytest.mark.slow if slow else ()
    return pytest.param(world, layout, {**MOE, **config}, id=tag, marks=marks)


CASES = [
    # (world, train_layout arguments, model config beyond MOE)
    # the fast tier: ep alone, with tp and sequence parallelism, with pp, with ZeRO-1 (ep 4
    # and the all-gather dispatcher are held to one process there by test_moe_parallel)
    case(2, {"ep": 2}, {}, name="dp2"),
    case(4, {"ep": 4}, {"moe_token_dispatcher_type": "allgather"}, slow=True, name="dp4-allgather"),
    case(4, {"tp": 2, "ep": 2}, SP, name="sp"),
    case(4, {"pp": 2, "ep": 2}, {"activation": "swiglu", "add_bias_linear": False}),
    case(4, {"ep": 2}, {}, slow=True, name="dp4-edp2"),
    case(4, {"tp": 2, "ep": 2, "etp": 1}, SP, slow=True, name="sp"),
    case(4, {"cp": 2, "ep": 2}, {"cp_comm_type": "p2p"}, slow=True),
    case(4, {"ep": 2}, {"moe_shared_expert_intermediate_size": 8}, slow=True, name="shared"),
    case(8, {"tp": 2, "pp": 2, "ep": 2}, {**SP, "moe_layer_freq": 1}, slow=True),
    case(4, {"ep": 2, "zero_stage": 1}, {}, name="dp4-edp2-zero1"),
    case(4, {"ep": 2}, FULL_RECOMPUTE, slow=True, name="dp4-full-recompute"),
    case(4, {"tp": 2, "ep": 2, "etp": 1, "zero_stage": 1}, SP, slow=True, name="sp-edp2-zero1"),
    # ZeRO-2 and 3 shard the experts' gradients and weights over the expert-data-parallel
    # group (2 ranks here), the rest over the data-parallel one
    case(4, {"ep": 2, "zero_stage": 2}, {}, name="dp4-edp2-zero2"),
    case(4, {"ep": 2, "zero_stage": 3}, {}, slow=True, name="dp4-edp2-zero3"),
    case(4, {"tp": 2, "ep": 2, "etp": 1, "zero_stage": 2}, SP, slow=True, name="sp-edp2-zero2"),
]


@pytest.mark.parametrize("world_size, layout, config", CASES)
@distributed(timeout=240)
def test_moe_training_matches_single_process(world_size, layout, config):
    layout = {"tp": 1, "pp": 1, "vpp": None, **layout}
    tp, pp, vpp = layout.pop("tp"), layout.pop("pp"), layout.pop("vpp")
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, **layout, **config)
    check_against_reference(chunks, losses, norms, first_grads, config)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="need sequence_parallel"):
        gpt_config(**MOE, tensor_model_parallel_size=2)


def test_dense_and_moe_layers_alternate():
    model = GPTModel(gpt_config(**MOE))
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["MoELayer", "ParallelMLP"] * 4
    assert torch.is_tensor(model.decoder.layers[0].mlp.experts.fc1)


def test_model_flops_count_the_chosen_experts_and_the_router():
    dense = gpt_config(num_layers=2)
    moe = gpt_config(num_layers=2, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=2)
    h, f = dense.hidden_size, dense.ffn_hidden_size
    extra = 3 * 10 * (2 * h * 8 + 4 * h * f)  # one MoE layer: a second MLP and the router
    assert gpt_training_flops(moe, 8, 10) - gpt_training_flops(dense, 8, 10) == extra
