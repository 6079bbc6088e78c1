"""A model field reaches the training config, the planner and the FLOPs count from the flags
with no code of its own: the training config passes every flag named after a GPTConfig field
by name (Megatron's otherwise-spelled flags are translated in one place), and the planner and
the FLOPs formula read the GPTConfig itself."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from megapp.models.gpt import GPTConfig
from megapp.planning.hardware import load_hardware
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.layout_space import Space, layouts
from megapp.planning.models import ModelPreset
from megapp.planning.search import Planner
from megapp.planning.timing import predict_step_time
from megapp.training.arguments import config_from_flags
from megapp.training.flag_groups import ModelArgs
from megapp.training.flops import gpt_training_flops
from megapp.training.parallel_flags import ParallelArgs

VOCAB = 1000
SHAPE = shlex.split(
    "--num-layers 8 --hidden-size 128 --num-attention-heads 8 --num-query-groups 2 "
    "--group-query-attention --kv-channels 24 --ffn-hidden-size 320 --swiglu "
    "--hidden-dropout 0.05 --attention-dropout 0 --disable-bias-linear --add-qkv-bias "
    "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
    "--rotary-base 500000 --rotary-percent 0.5 --use-rope-scaling --rope-scaling-factor 4 "
    "--rope-low-freq-factor 2 --rope-high-freq-factor 6 "
    "--rope-original-max-position-embeddings 4096 --attention-backend fused_softmax "
    "--init-method-std 0.01 --make-vocab-size-divisible-by 64 --seq-length 256 "
    "--max-position-embeddings 512 --untie-embeddings-and-output-weights --bf16"
)
"""Model flags that give every field of the model a value other than its default."""
SIZES = shlex.split(
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
    "--context-parallel-size 2 --cp-comm-type a2a"
)
RECOMPUTE = shlex.split(
    "--recompute-granularity full --recompute-method block --recompute-num-layers 2"
)
LAYOUT = [
    *SIZES,
    *shlex.split("--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 6"),
    *RECOMPUTE,
]
COUNTED_LAYOUT = [
    *SIZES,
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    *RECOMPUTE,
]
"""The layout once with the end stages' layer counts given, once with the embedding and the
loss counted in the split (the two cannot go together)."""
EXPERTS = shlex.split(
    "--num-experts 8 --moe-layer-freq 2 --moe-ffn-hidden-size 96 --moe-router-topk 3 "
    "--moe-router-pre-softmax --moe-router-norm-topk-prob "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 "
    "--moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1.5 --moe-token-drop-policy position "
    "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate "
    "--moe-token-dispatcher-type allgather "
    "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1"
)
"""Mixture-of-experts flags that move every expert field off its default but one."""
SIGMOID_ROUTER = shlex.split(
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 0.01 --moe-router-force-load-balancing "
    "--moe-token-dispatcher-type hierarchical --moe-dispatch-node-size 2"
)
"""DeepSeek-V3's router, which takes no pre-softmax, and its expert bias, and the
hierarchical dispatcher with its node: the last expert fields, in a second run."""
NOT_FLAGS = {
    # the local experts' kernel: one grouped matmul or a loop over experts, the same numbers
    "moe_grouped_gemm",
}
RUN = shlex.split("--micro-batch-size 1 --lr 1e-4 --train-iters 1 --use-default-corpus")
FROM_OTHER_GROUPS = {
    "params_dtype",  # --bf16 / --fp16
    "vocab_size",  # the tokenizer's
    "num_layers_in_first_pipeline_stage",  # --decoder-first-pipeline-num-layers
    "num_layers_in_last_pipeline_stage",  # --decoder-last-pipeline-num-layers
}


def test_every_gpt_field_comes_from_the_flags():
    """Each GPTConfig field is a flag of its own name passed as it is, a Megatron spelling
    translated by ModelArgs, or set from another group; the flags above move every field
    off its default, so a field no flag reaches would fail here, by name."""
    dropped = ("--moe-router-pre", "--moe-router-norm", "--moe-token-dispatcher-type", "allgather")
    sigmoid = [f for f in EXPERTS if not f.startswith(dropped)]
    runs = [
        [*SHAPE, *EXPERTS, *LAYOUT, "--tp-comm-overlap", *RUN],
        [*SHAPE, *sigmoid, *SIGMOID_ROUTER, *COUNTED_LAYOUT, *RUN],
    ]
    configs = [config_from_flags(flags, world_size=8) for flags in runs]
    own_name = {f.name for group in (ModelArgs, ParallelArgs) for f in dataclasses.fields(group)}
    for field in dataclasses.fields(GPTConfig):
        if field.name in NOT_FLAGS:
            continue
        moved = False
        for config in configs:
            value = getattr(config.gpt_config(VOCAB), field.name)
            translated = config.model.gpt_fields_spelled_otherwise
            if field.name in translated:
                assert value == translated[field.name], field.name
            elif field.name in own_name:
                group = config.model if hasattr(config.model, field.name) else config.parallel
                assert value == getattr(group, field.name), field.name
            else:
                assert field.name in FROM_OTHER_GROUPS, f"no flag sets GPTConfig.{field.name}"
            moved |= field.default is dataclasses.MISSING or value != field.default
        assert moved, f"the flags leave GPTConfig.{field.name} at its default"


@pytest.fixture(scope="module")
def planner():
    return Planner(ModelPreset(tuple(SHAPE), VOCAB, "every field set"), load_hardware("h100"), 8, 4)


def test_the_planner_sees_the_model_pretrain_gpt_builds(planner):
    """For every layout of the planner's space: its GPTConfig equals, field for field, the
    one ``pretrain_gpt.py`` builds from the model flags and the layout's printed flags, and
    so do the model FLOPs the planner and the training log count."""
    limits = Space(max_micro_batch_size=1, max_chunks=1, schedules=("1f1b",))
    space = list(layouts(planner.base, 4, 8, 8, limits))
    assert {layout.tp for layout in space} == {1, 2}
    for layout in space:
        flags = [*SHAPE, *layout.flags(8), "--global-batch-size", "8", *RUN]
        built = config_from_flags(flags, world_size=layout.world_size).gpt_config(VOCAB)
        assert planner.gpt(layout) == built, layout.name
        tokens = 8 * 256
        assert gpt_training_flops(planner.gpt(layout), 256, tokens) == gpt_training_flops(
            built, 256, tokens
        )


def test_the_predicted_throughput_counts_the_flops_of_the_gpt_config():
    layout = Layout(tp=2, pp=2, sequence_parallel=True)
    config = pretrain_config(layout, SHAPE, 8)
    step = predict_step_time(config, VOCAB, load_hardware("h100"))
    flops = gpt_training_flops(config.gpt_config(VOCAB), 256, 8 * 256)
    assert step.tflops_per_gpu * 1e12 * step.seconds * 4 == pytest.approx(flops, rel=1e-12)
