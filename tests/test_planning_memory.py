"""The memory model: a chunk's held activations equal what megapp's GPT chunks keep (counted
by the live-tensor counter), the in-flight counts follow the schedule, the state follows
the ZeRO stage; the whole peak is checked against pretrain_gpt.py runs in
tests/test_pretrain_e2e.py and by the ablation sweep."""

from __future__ import annotations

import pytest
import torch

from megapp.models import GPTConfig, build_gpt_chunks
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.memory import chunk_activation_bytes, predict_memory
from megapp.planning.model_state import model_state, rank_parameters
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.training.live_memory import LiveTensorMemory

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4"]
MODEL += ["--seq-length", "32"]
VOCAB = 257


# fast: gpt-1-2, the plain model's last stage, which receives its input from another
@pytest.mark.parametrize(
    "pp_rank, pp",
    [
        pytest.param(0, 1, marks=pytest.mark.slow),
        pytest.param(0, 2, marks=pytest.mark.slow),
        (1, 2),
        pytest.param(1, 3, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "settings",
    [
        {},
        pytest.param({"recompute_granularity": "selective"}, marks=pytest.mark.slow),
        pytest.param({"activation": "swiglu"}, marks=pytest.mark.slow),
    ],
    ids=["gpt", "selective", "swiglu"],
)
def test_a_chunk_holds_what_the_model_predicts(pp_rank, pp, settings):
    config = GPTConfig(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        make_vocab_size_divisible_by=128,
        **settings,
    )
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    (chunk,) = build_gpt_chunks(config, pp_rank=pp_rank, pp_size=pp)
    s, b = 32, 2
    ids, labels = torch.randint(0, VOCAB, (b, s)), torch.randint(0, VOCAB, (b, s))
    received = None if chunk.pre_process else torch.randn(s, b, 64, requires_grad=True)
    with LiveTensorMemory() as memory:
        batch = ids.clone() if chunk.pre_process else None  # arrives during the iteration
        out = chunk(
            input_ids=batch,
            hidden_states=received,
            labels=labels if chunk.post_process else None,
        )
        sent = 0 if chunk.post_process else out.nbytes  # the engine frees it once sent
        memory.sweep()
        held = memory.current() - memory.start - sent
    if received is not None:
        held += received.nbytes  # received during the iteration in a pipeline
    layers = 6 // pp
    predicted = chunk_activation_bytes(config, layers, chunk.pre_process, chunk.post_process, s, b)
    assert held == predicted


@pytest.mark.parametrize("schedule, expected", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_in_flight_follows_the_schedule(schedule, expected):
    config = pretrain_config(Layout(pp=4, schedule=schedule), MODEL, global_batch_size=8)
    assert [m.in_flight for m in predict_memory(config, VOCAB)] == expected


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_follows_the_zero_stage(zero):
    layout = Layout(pp=2, dp=2, zero_stage=zero)
    config = pretrain_config(layout, MODEL, global_batch_size=4)
    model = config.gpt_config(VOCAB)
    for rank, memory in enumerate(predict_memory(config, VOCAB)):
        stages = config.schedule.placement[rank]
        params = rank_parameters(model, stages, 2)
        state = model_state(params, model.params_dtype, dp=2, zero_stage=zero)
        assert (memory.weights, memory.optimizer) == (state.weights, state.optimizer)
        # ZeRO-2 keeps the embedding's and output layer's gradients whole: they are summed
        # over the first and last stage before they are reduce-scattered
        whole = (384 * 64 + 32 * 64) * 4 / 2 if zero >= 2 else 0  # vocab padded, positions
        assert memory.grads == state.grads + whole


def test_recompute_and_sequence_parallelism_lower_the_peak():
    def peak(**layout):
        config = pretrain_config(Layout(tp=2, pp=2, **layout), MODEL, global_batch_size=8)
        return max(m.activations for m in predict_memory(config, VOCAB))

    plain = peak()
    assert peak(recompute="selective") < plain
    assert peak(recompute="full") < peak(recompute="selective")
    assert peak(sequence_parallel=True) < plain
