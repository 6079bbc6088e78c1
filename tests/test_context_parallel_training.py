"""GPT training with context parallelism against the single-process run.

Each cp rank holds two chunks of every sequence (the load-balanced causal split), runs
everything but attention on them alone, and reaches the other ranks' keys and values by
one of the three mechanisms. The loss is each rank's share scaled by cp (its kept-token
count summed over cp), gradients are reduced over data × context ranks. Held, as every
layout, to five steps of the single-process model: each step's loss and gradient norm,
step 1's gathered gradients, the parameters at the end (tolerances in tests/support.py).
"""

from __future__ import annotations

import pytest

from megapp.testing import distributed
from tests.support import check_against_reference, train_layout

LLAMA = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "share_embeddings_and_output_weights": False,
    "num_query_groups": 2,
}


def case(world, tp, cp, pp, vpp, settings, config, *, slow=False, name=""):
    tag = f"tp{tp}-cp{cp}-pp{pp}-{config['cp_comm_type']}" + (f"-{name}" if name else "")
    marks = pytest.mark.slow if slow else ()
    return pytest.param(world, tp, cp, pp, vpp, settings, config, id=tag, marks=marks)


FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}

CASES = [
    # (world, tp, cp, pp, vpp, extra train_layout settings, model config); the fast tier
    # holds each mechanism, tp with sequence parallelism, pp and ZeRO under cp 2
    case(2, 1, 2, 1, None, {}, {"cp_comm_type": "p2p"}, name="gpt"),
    case(2, 1, 2, 1, None, {}, {"cp_comm_type": "all_gather", **LLAMA}, name="llama"),
    case(2, 1, 2, 1, None, {}, {"cp_comm_type": "a2a", **LLAMA}, name="llama"),
    case(4, 1, 4, 1, None, {}, {"cp_comm_type": "p2p", **LLAMA}, slow=True, name="llama"),
    case(4, 2, 2, 1, None, {}, {"cp_comm_type": "p2p", "sequence_parallel": True}, name="sp"),
    case(
        4,
        1,
        2,
        2,
        None,
        {},
        {"cp_comm_type": "p2p", "recompute_granularity": "selective"},
        name="1f1b-selective",
    ),
    case(4, 1, 2, 1, None, {"zero_stage": 2}, {"cp_comm_type": "all_gather"}, name="dp2-zero2"),
    case(4, 1, 4, 1, None, {}, {"cp_comm_type": "a2a"}, slow=True),
    case(4, 1, 2, 1, None, {"zero_stage": 3}, {"cp_comm_type": "p2p"}, slow=True, name="dp2-zero3"),
    case(
        4,
        1,
        2,
        1,
        None,
        {"distributed_optimizer": True},
        {"cp_comm_type": "a2a"},
        slow=True,
        name="dp2-zero1",
    ),
    case(4, 1, 4, 1, None, {}, {"cp_comm_type": "all_gather"}, slow=True),
    case(
        4,
        1,
        2,
        2,
        2,
        {"schedule": "zb-v"},
        {"cp_comm_type": "a2a", **LLAMA},
        slow=True,
        name="zb-v-llama",
    ),
    case(
        8,
        2,
        2,
        2,
        None,
        {"zero_stage": 2},
        {"cp_comm_type": "all_gather", "sequence_parallel": True, **FULL_RECOMPUTE},
        slow=True,
        name="sp-dp2-zero2-full-recompute",
    ),
]


@pytest.mark.parametrize("world_size, tp, cp, pp, vpp, settings, config", CASES)
@distributed(timeout=240)
def test_context_parallel_training_matches_single_process(
    world_size, tp, cp, pp, vpp, settings, config
):
    chunks, losses, norms, first_grads = train_layout(tp, pp, vpp, cp=cp, **settings, **config)
    check_against_reference(chunks, losses, norms, first_grads, config)
