"""A planner's layout becomes the flags pretrain_gpt.py runs, checked by the same config."""

from __future__ import annotations

import pytest

from megapp.planning.layout import PIPEDREAM_VSYNC, Layout, apply_layout, pretrain_config
from megapp.training.arguments import config_from_flags
from megapp.training.flag_groups import ArgumentsError

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4"]
MODEL += ["--seq-length", "32"]


def test_the_config_runs_the_layout():
    layout = Layout(
        tp=2,
        pp=2,
        dp=2,
        vpp=2,
        schedule="zb-v",
        sequence_parallel=True,
        recompute="full",
        zero_stage=1,
    )
    config = pretrain_config(layout, MODEL, global_batch_size=16)
    parallel = config.parallel
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (2, 2)
    assert config.data_parallel_size == 2 and config.world_size == layout.world_size == 8
    assert config.virtual_pipeline_model_parallel_size == 2
    assert config.schedule.name == "zb-v" and config.num_microbatches == 8
    model = config.gpt_config(vocab_size=100)
    assert model.sequence_parallel and model.recompute_granularity == "full"
    assert (model.recompute_method, model.recompute_num_layers) == ("uniform", 1)
    assert parallel.zero_stage == 1
    assert layout.name == "tp2.pp2.dp2.v2.mb1.zb-v.sp.full.z1"


def test_the_default_schedule_is_megatrons():
    assert pretrain_config(Layout(pp=2), MODEL, 4).schedule.name == "1f1b"
    interleaved = pretrain_config(Layout(pp=2, vpp=2), MODEL, 4)
    assert interleaved.schedule.name == "interleaved-1f1b"


def test_pipedream_with_vertical_sync_is_a_schedule_of_its_own():
    layout = Layout(pp=2, dp=2, schedule=PIPEDREAM_VSYNC)
    flags = layout.flags(8)
    assert flags[-3:] == ["--pipeline-schedule", "pipedream", "--vertical-sync"]
    assert layout.name == "tp1.pp2.dp2.v1.mb1.pipedream-vsync.norecompute.z0"
    asynchronous = [*MODEL, "--clip-grad", "0", "--untie-embeddings-and-output-weights"]
    config = pretrain_config(layout, asynchronous, global_batch_size=8)
    assert config.parallel.vertical_sync and config.schedule.name == PIPEDREAM_VSYNC
    assert config.schedule.asynchronous
    plain = pretrain_config(Layout(pp=2, dp=2, schedule="pipedream"), asynchronous, 8)
    assert not plain.parallel.vertical_sync and plain.schedule.name == "pipedream"
    with pytest.raises(ArgumentsError, match="set --clip-grad to 0"):
        pretrain_config(layout, MODEL, global_batch_size=8)


@pytest.mark.parametrize(
    "layout, global_batch, message",
    [
        (Layout(pp=3), 6, "--num-layers"),
        (Layout(dp=2, micro_batch_size=2), 6, "--global-batch-size"),
        (Layout(pp=2, vpp=2, schedule="1f1b"), 4, "--num-layers-per-virtual-pipeline-stage"),
        (Layout(tp=3), 4, "heads"),
    ],
)
def test_a_layout_pretrain_gpt_refuses_is_refused_with_its_message(layout, global_batch, message):
    with pytest.raises(ArgumentsError, match=message):
        pretrain_config(layout, MODEL, global_batch)


def test_bad_layout_values_fail_at_once():
    with pytest.raises(ValueError, match="sequence parallelism needs tp > 1"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match="recompute must be one of"):
        Layout(recompute="everything")
    with pytest.raises(ValueError, match="do not split into 2 pipeline ranks × 3 chunks"):
        Layout(pp=2, vpp=3).flags(8)
    with pytest.raises(ValueError, match="--num-layers"):
        pretrain_config(Layout(), ["--hidden-size", "64"], 1)


RUN = ["--lr", "1e-4", "--train-iters", "1", "--use-default-corpus"]


@pytest.mark.parametrize(
    "layout",
    [
        Layout(),
        Layout(tp=2, pp=2, dp=2, vpp=2, sequence_parallel=True, recompute="full", zero_stage=1),
        Layout(pp=2, dp=2, vpp=2, schedule="zb-v", micro_batch_size=2, recompute="selective"),
        Layout(pp=4, schedule="zb-h1", zero_stage=3, dp=2),
        Layout(pp=2, dp=2, schedule=PIPEDREAM_VSYNC),
        Layout(pp=2, dp=2, vpp=5, embedding_in_split=True, loss_in_split=True),
        Layout(tp=2, dp=2, sequence_parallel=True, tp_comm_overlap=True),
    ],
    ids=lambda layout: layout.name,
)
def test_the_printed_flags_parse_to_the_config_the_layout_applies(layout):
    """``pretrain_config`` applies the layout to the model's parsed groups; parsing the
    flags it prints for ``pretrain_gpt.py`` gives the same config, every group and every
    derived value; applied to another layout's config it gives this one's."""
    model = [*MODEL, "--clip-grad", "0", "--untie-embeddings-and-output-weights"]
    flags = [*model, *layout.flags(8), "--global-batch-size", "16", *RUN]
    parsed = config_from_flags(flags, world_size=layout.world_size)
    applied = pretrain_config(layout, model, global_batch_size=16)
    assert applied == parsed
    assert apply_layout(pretrain_config(Layout(tp=4), model, 4), layout, 16) == parsed
