"""GPT training with mixture-of-experts layers against the single-process run.

Every second layer's MLP is a mixture of experts (dropless, top 2 of 4, with the
load-balancing and z losses on). Expert parameters are reduced over the
expert-data-parallel group, the rest over data × context ranks; the auxiliary losses are
scaled as the main loss is. Held, as every layout, to the same steps of the single-process
model: each step's loss and gradient norm (so the auxiliary losses' gradients too), step
1's gathered gradients (experts gathered over the expert-parallel ranks), the parameters
at the end (tolerances in tests/support.py).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from megapp import parallel_state as ps
from megapp.checkpointing import load_checkpoint, save_checkpoint
from megapp.models import GPTModel
from megapp.testing import distributed
from megapp.training import train_step
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.flops import gpt_training_flops
from megapp.training.setup import build_training_setup
from tests.support import (
    CLIP,
    GPT_TOL,
    LR,
    MOE_CONFIG,
    SEED,
    WD,
    check_against_reference,
    global_batch,
    gpt_config,
    gpt_forward_step,
    train_layout,
)

MOE = MOE_CONFIG
SP = {"sequence_parallel": True}
FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 2,
}

EXPERT_BIAS = {
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 1e-2,  # moves the routing within the steps
}


def case(world, layout, config, *, slow=False, name=""):
    tag = "-".join(f"{k}{v}" for k, v in layout.items()) + (f"-{name}" if name else "")
    marks = pytest.mark.slow if slow else ()
    return pytest.param(world, layout, {**MOE, **config}, id=tag, marks=marks)


CASES = [
    # (world, train_layout arguments, model config beyond MOE)
    # the fast tier: ep alone, with tp and sequence parallelism, with pp, with ZeRO-1 and the
    # expert bias, with ZeRO-2 (ep 4 and the all-gather dispatcher are held to one process
    # there by test_moe_parallel)
    case(2, {"ep": 2}, {}, name="dp2"),
    case(4, {"ep": 4}, {"moe_token_dispatcher_type": "allgather"}, slow=True, name="dp4-allgather"),
    case(
        4,
        {"ep": 4},
        {"moe_token_dispatcher_type": "hierarchical", "moe_dispatch_node_size": 2},
        slow=True,
        name="dp4-hierarchical",
    ),
    case(4, {"tp": 2, "ep": 2}, SP, name="sp"),
    case(4, {"pp": 2, "ep": 2}, {"activation": "swiglu", "add_bias_linear": False}),
    case(4, {"ep": 2}, {}, slow=True, name="dp4-edp2"),
    case(4, {"tp": 2, "ep": 2, "etp": 1}, SP, slow=True, name="sp"),
    case(4, {"cp": 2, "ep": 2}, {"cp_comm_type": "p2p"}, slow=True),
    case(4, {"ep": 2}, {"moe_shared_expert_intermediate_size": 8}, slow=True, name="shared"),
    case(8, {"tp": 2, "pp": 2, "ep": 2}, {**SP, "moe_layer_freq": 1}, slow=True),
    case(4, {"ep": 2, "zero_stage": 1}, {}, slow=True, name="dp4-edp2-zero1"),
    # DeepSeek-V3's expert bias: moved each step by the pairs routed over tp × cp × dp (the
    # fast tier holds it with expert ZeRO-1)
    case(4, {"ep": 2}, EXPERT_BIAS, slow=True, name="dp4-expert-bias"),
    case(4, {"ep": 2, "zero_stage": 1}, EXPERT_BIAS, name="dp4-edp2-zero1-expert-bias"),
    case(4, {"tp": 2, "ep": 2}, {**SP, **EXPERT_BIAS}, slow=True, name="sp-expert-bias"),
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
    if config.get("moe_router_enable_expert_bias"):
        _check_expert_biases(chunks)


def _check_expert_biases(chunks):
    """The routers' biases have moved, and each is the same on every rank (the router is
    replicated, so every rank must have summed the same counts)."""
    biases = [m.expert_bias for c in chunks for m in c.modules() if hasattr(m, "expert_bias")]
    biases = [b for b in biases if b is not None]
    assert biases and any(b.any() for b in biases)
    mine = torch.stack(biases)
    first = mine.clone()
    torch.distributed.broadcast(first, src=0)
    torch.testing.assert_close(mine, first, rtol=0, atol=0)


def _biased_setup(ep: int, seed: int):
    ps.initialize_model_parallel(1, 1, None, expert_model_parallel_size=ep)
    experts = {"expert_model_parallel_size": ep} if ep > 1 else {}
    optimizer = OptimizerArgs(
        lr=LR, weight_decay=WD, clip_grad=CLIP, lr_decay_style="constant", lr_decay_iters=4
    )
    model = gpt_config(**MOE, **EXPERT_BIAS, **experts)
    return build_training_setup(model, optimizer, bucket_size=2000, seed=seed)


def _biased_steps(setup, steps) -> list[float]:
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses = []
    for step in steps:
        batch = global_batch(step, dp)
        mine = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
        result = train_step(
            gpt_forward_step,
            [iter(mine)],
            setup.chunks,
            setup.optimizer,
            num_microbatches=len(mine),
            groups=setup.groups,
        )
        losses.append(result.loss)
    return losses


def _biases(setup) -> list[torch.Tensor]:
    return [m.expert_bias.clone() for m in setup.chunks[0].modules() if hasattr(m, "expert_bias")]


@distributed(world_size=2, timeout=240)
def test_the_expert_bias_is_saved_and_loads_under_another_expert_layout():
    path = [tempfile.mkdtemp(prefix="megapp-bias-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(path)
    setup = _biased_setup(ep=2, seed=SEED)
    _biased_steps(setup, range(2))
    save_checkpoint(path[0], 2, setup.chunks, setup.optimizer, groups=setup.groups)
    saved = _biases(setup)
    expected = _biased_steps(setup, [2, 3])
    ps.destroy_model_parallel()

    fresh = _biased_setup(ep=1, seed=SEED + 1)
    assert all(not b.any() for b in _biases(fresh))
    load_checkpoint(path[0], fresh.chunks, fresh.optimizer, groups=fresh.groups)
    loaded = _biases(fresh)
    assert len(loaded) == len(saved) and any(b.any() for b in saved)  # some have moved
    for ours, theirs in zip(loaded, saved, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    losses = _biased_steps(fresh, [2, 3])
    torch.testing.assert_close(losses, expected, **GPT_TOL)
    ps.destroy_model_parallel()


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


def test_forced_balance_recomputes_the_same_routing():
    """With the router's logits replaced by random ones (moe_router_force_load_balancing),
    full recompute draws the same logits again in backward: loss and every gradient equal
    the run that keeps its activations, and differ from the router's own routing."""
    from megapp.tensor_parallel.random import model_parallel_manual_seed

    tokens, labels, _ = global_batch(0, 1)[0]

    def run(**overrides) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(SEED)
        model = GPTModel(gpt_config(**MOE, **overrides))
        model_parallel_manual_seed(SEED)
        loss = model(input_ids=tokens, labels=labels).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    forced = {"moe_router_force_load_balancing": True}
    kept, recomputed = run(**forced), run(**forced, **FULL_RECOMPUTE)
    torch.testing.assert_close(recomputed[0], kept[0], rtol=0, atol=0)
    for a, b in zip(kept[1], recomputed[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    routed_by_the_router = run()[0]
    assert not torch.equal(routed_by_the_router, kept[0])
