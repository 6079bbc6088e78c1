"""The Python API holds up where the command line does: a ZeRO-3 weight read outside
``full_weights()`` raises a clear error instead of reading freed memory, and a model run
under ``torch.func.functional_call`` gets the gradients of the weights it was given."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call

from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.models import GPTModel
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.testing import distributed
from megapp.training import TrainGroups
from megapp.transformer import TransformerBlock, TransformerConfig, TransformerLayer
from tests.support import SEED, global_batch, gpt_config, masked_mean

RELEASED = r"releases between its layer's uses.*full_weights\(\)"


# ----- ZeRO-3: released weights ---------------------------------------------------------


def _zero3_model() -> tuple[DistributedDataParallel, GPTModel, GPTModel]:
    """A two-layer GPT under ZeRO-3 over two ranks, and the same model unsharded."""
    ps.initialize_model_parallel(1, 1)
    groups = TrainGroups.from_parallel_state()
    config = gpt_config(num_layers=2)
    reference = GPTModel(config, seed=SEED)
    model = GPTModel(config, seed=SEED)
    ddp = DistributedDataParallel(
        model,
        dp_group=groups.dp,
        bucket_size=300,  # several buckets per layer
        zero_stage=3,
    )
    return ddp, model, reference


def _check_released(model: GPTModel, reference: GPTModel) -> None:
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    # Metadata is the full parameter's: the count of weights is the model's.
    assert weight.shape == reference.decoder.layers[0].mlp.linear_fc1.weight.shape
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters())
    with pytest.raises(RuntimeError, match=f"sum needs the values of the parameter {name}"):
        weight.sum()
    assert name in repr(weight)
    with pytest.raises(RuntimeError, match=RELEASED):
        weight.data.clone()
    with pytest.raises(RuntimeError, match=RELEASED):  # views made without a torch function
        weight.as_subclass(torch.Tensor)
    with pytest.raises(RuntimeError, match=RELEASED):
        torch.from_dlpack(weight)
    with pytest.raises(RuntimeError, match=RELEASED):
        model.state_dict()
    with pytest.raises(RuntimeError, match=RELEASED):
        torch.cat([p.flatten() for p in model.parameters()])
    with pytest.raises(RuntimeError, match=RELEASED):
        model.load_state_dict(reference.state_dict())


@distributed(world_size=2, timeout=180)
def test_zero3_weights_outside_full_weights_raise_a_clear_error():
    ddp, model, reference = _zero3_model()
    _check_released(model, reference)

    with ddp.full_weights():
        state = model.state_dict()
        assert float(model.decoder.layers[0].mlp.linear_fc1.weight.sum()) == float(
            reference.decoder.layers[0].mlp.linear_fc1.weight.sum()
        )
    # The values state_dict() gave inside the block are copies: still readable after it.
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key

    # Released again after a forward and backward (the layers gather and free on their own).
    tokens, labels, mask = global_batch(0, 2)[dist.get_rank()]
    masked_mean(ddp(input_ids=tokens, labels=labels), mask).backward()
    ddp.finish_grad_sync()
    _check_released(model, reference)

    # What is written inside the block is kept.
    with torch.no_grad(), ddp.full_weights():
        model.decoder.layers[1].self_attention.linear_proj.weight.fill_(0.5)
    with ddp.full_weights():
        assert bool((model.decoder.layers[1].self_attention.linear_proj.weight == 0.5).all())
    ps.destroy_model_parallel()


# ----- torch.func.functional_call: recompute with the forward's weights ------------------


def _config(**overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(overrides)
    return TransformerConfig(**base)


CASES = {
    "layer-LayerNorm": (TransformerLayer, {}),
    "layer-RMSNorm": (TransformerLayer, {"normalization": "RMSNorm", "activation": "swiglu"}),
    "block-selective": (TransformerBlock, {"recompute_granularity": "selective"}),
    "block-full-uniform": (
        TransformerBlock,
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    ),
    "block-full-block": (
        TransformerBlock,
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_functional_call_gradients_equal_a_module_holding_those_weights(case):
    """Both runs do the same fp32 ops on the same values, so they agree to round-off:
    1e-6 relative (a few ulps) is far below what a recompute with the module's own
    weights gives (errors of order one here)."""
    kind, overrides = CASES[case]
    model_parallel_manual_seed(0)
    config = _config(**overrides)
    module = TransformerLayer(config, 1) if kind is TransformerLayer else TransformerBlock(config)
    g = torch.Generator().manual_seed(1)
    weights = {
        name: (p.detach() + 0.3 * torch.randn(p.shape, generator=g)).requires_grad_()
        for name, p in module.named_parameters()
    }
    holder = copy.deepcopy(module)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(weights[name])
    x = torch.randn(8, 2, 16, generator=g)

    functional_call(module, weights, (x,)).square().sum().backward()
    holder(x).square().sum().backward()
    for name, p in holder.named_parameters():
        torch.testing.assert_close(
            weights[name].grad, p.grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert all(p.grad is None for p in module.parameters())  # the module's own got nothing
