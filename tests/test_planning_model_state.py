"""The planner's parameter count per rank equals the chunks megapp builds, for every
model option and pipeline placement; tools/benchmarks/zero_memory.py (tests/test_zero_memory.py)
holds its model-state bytes to the measured buffers and optimizer states."""

from __future__ import annotations

import pytest
import torch

from megapp import parallel_state as ps
from megapp.models import GPTConfig, build_gpt_chunks
from megapp.pipeline_parallel.catalog import build_schedule
from megapp.planning import model_state, rank_parameters
from megapp.testing import distributed

CONFIGS = {
    "gpt": {},
    "llama": {
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "num_query_groups": 2,
        "share_embeddings_and_output_weights": False,
    },
    "qwen": {"add_bias_linear": False, "add_qkv_bias": True, "num_query_groups": 2},
    "padded": {"make_vocab_size_divisible_by": 8, "ffn_hidden_size": 24, "kv_channels": 6},
}
LAYOUTS = [  # (pp, schedule, v, first/last stage layers)
    (1, "1f1b", 1, None),
    (2, "1f1b", 1, None),
    (4, "1f1b", 1, None),
    (2, "interleaved-1f1b", 2, None),
    (2, "zb-v", 2, None),
    (4, "zb-v", 2, None),
    (4, "1f1b", 1, (1, 3)),
]


def _config(name: str, tp: int = 1) -> GPTConfig:
    return GPTConfig(
        num_layers=8,
        hidden_size=16,
        num_attention_heads=4,
        vocab_size=37,
        max_position_embeddings=8,
        tensor_model_parallel_size=tp,
        **CONFIGS[name],
    )


def _built(config, pp, rank, v, stages, uneven, tp_group=None) -> int:
    first, last = uneven or (None, None)
    chunks = build_gpt_chunks(
        config,
        pp_rank=rank,
        pp_size=pp,
        vpp_size=v if v > 1 else None,
        tp_group=tp_group,
        stages=stages,
        first_stage_layers=first,
        last_stage_layers=last,
    )
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_per_rank_equal_the_built_chunks(name):
    config = _config(name)
    for pp, schedule, v, uneven in LAYOUTS:
        placement = build_schedule(schedule, pp, 2 * pp, v).placement
        first, last = uneven or (None, None)
        for rank in range(pp):
            expected = _built(config, pp, rank, v, placement[rank], uneven)
            counted = rank_parameters(
                config,
                placement[rank],
                pp * v,
                first_stage_layers=first,
                last_stage_layers=last,
            )
            assert counted == expected, (name, pp, schedule, rank)


@distributed(world_size=2)
def test_parameters_per_tensor_parallel_rank():
    ps.initialize_model_parallel(2, 1)
    group = ps.get_tensor_model_parallel_group()
    for name in sorted(CONFIGS):
        config = _config(name, tp=2)
        assert rank_parameters(config, [0], 1) == _built(config, 1, 0, 1, [0], None, group)


def test_model_state_by_zero_stage():
    bf16 = [model_state(1000, torch.bfloat16, 4, stage) for stage in range(4)]
    assert [(s.weights, s.grads, s.optimizer) for s in bf16] == [
        (2000, 4000, 12000),
        (2000, 4000, 3000),
        (2000, 1000, 3000),
        (500, 1000, 3000),
    ]
    fp32 = model_state(1000, torch.float32)
    assert (fp32.weights, fp32.grads, fp32.optimizer, fp32.total) == (4000, 4000, 8000, 16000)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        model_state(1000, torch.float32, 2, 4)
