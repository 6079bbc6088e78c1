"""Checkpoints: reshardable across layouts, exact on resume, atomic, safe to load, clear errors.

The distributed cases train the tiny GPT of tests/support.py a few steps under one
layout, save, and load under another. Loaded weights must equal the saved ones exactly
(they are the same numbers, only cut differently); the next step's loss under the new
layout matches the old layout's next step to the layout tests' tolerance (layouts sum
in different orders). Resuming under the same layout is exact: the losses equal the
uninterrupted run's bit for bit, dropout included.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shlex
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.checkpointing import (
    CheckpointError,
    TensorShard,
    iteration_dir,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    tensor_parallel_shard,
)
from megapp.distributed import DistributedDataParallel
from megapp.models import build_gpt_chunks
from megapp.optimizer import LRScheduler, Optimizer
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.testing import distributed
from megapp.training import TrainGroups, train_step
from megapp.training import checkpoints as training_checkpoints
from megapp.training.arguments import ArgumentsError, config_from_flags
from megapp.training.flag_groups import OptimizerArgs
from megapp.training.setup import TrainingSetup, build_training_setup
from tests.support import (
    GPT_TOL,
    SEED,
    VOCAB,
    full_tensor,
    global_batch,
    gpt_config,
    gpt_forward_step,
    reference_name,
)

# --- pieces of whole tensors (no processes) ---------------------------------------------


def _param(shape, *, dim=0, stride=1, unpadded=None):
    p = torch.nn.Parameter(torch.arange(float(torch.Size(shape).numel())).view(shape))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    if unpadded is not None:
        p.unpadded_size = unpadded
    return p


def test_a_column_slice_is_placed_at_its_rank():
    p = _param((3, 4), dim=1)
    shard = tensor_parallel_shard(p.data, p, tp_rank=2, tp_size=3)
    assert tuple(shard.shape) == (3, 12) and tuple(shard.offsets) == (0, 8)
    assert shard.local.data_ptr() == p.data.data_ptr()  # a view: loads write the param


def test_a_strided_slice_becomes_its_parts():
    # SwiGLU fc1 on rank 1 of 2: [gate rows 2-3; up rows 2-3] of a [2 × 4, h] weight
    p = _param((4, 3), stride=2)
    shard = tensor_parallel_shard(p.data, p, tp_rank=1, tp_size=2)
    assert tuple(shard.shape) == (2, 4, 3) and tuple(shard.offsets) == (0, 2, 0)
    assert torch.equal(shard.local[1], p.data[2:])


def test_vocabulary_padding_is_not_saved():
    # vocab 5 over tp 4: 8 padded rows, 2 per rank; rank 2 holds row 4 and one pad row
    p = _param((2, 3), unpadded=5)
    shard = tensor_parallel_shard(p.data, p, tp_rank=2, tp_size=4)
    assert tuple(shard.shape) == (5, 3) and tuple(shard.offsets) == (4, 0)
    assert tuple(shard.local.shape) == (1, 3)
    assert tensor_parallel_shard(p.data, p, tp_rank=3, tp_size=4) is None  # only padding


def test_shard_bad_input():
    with pytest.raises(ValueError, match="does not fit"):
        TensorShard(torch.zeros(3, 2), (2, 0), (4, 2))
    with pytest.raises(ValueError, match="one entry per dimension"):
        TensorShard(torch.zeros(3, 2), (0,), (4, 2))
    with pytest.raises(ValueError, match="contiguous"):
        TensorShard(torch.zeros(3, 2).t(), (0, 0), (2, 3))
    with pytest.raises(TypeError, match="TensorShard"):
        TensorShard(torch.zeros(2), (0,), (2,)) + 1


# --- the training-state checkpoint ---------------------------------------------------------


def _shared_tmpdir() -> str:
    path = [tempfile.mkdtemp(prefix="megapp-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


OPTIMIZER = OptimizerArgs(
    lr=1e-2,
    weight_decay=0.1,
    clip_grad=0.5,
    min_lr=1e-3,
    lr_warmup_iters=2,
    lr_decay_iters=8,
    lr_decay_style="cosine",
)


def _build(tp, pp, vpp=None, *, distributed_optimizer=False, zero_stage=0, seed=SEED, **config):
    ps.initialize_model_parallel(tp, pp, vpp)
    config = gpt_config(**{"tensor_model_parallel_size": tp, "num_layers": 4, **config})
    setup = build_training_setup(
        config,
        OPTIMIZER,
        bucket_size=1500,
        zero_stage=max(zero_stage, int(distributed_optimizer)),
        seed=seed,
    )
    model_parallel_manual_seed(seed)
    return setup.chunks, setup.optimizer, setup.scheduler, setup.groups


def _train(chunks, optimizer, scheduler, groups, steps) -> list[float]:
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses = []
    for step in steps:
        batch = global_batch(step, 1)  # the same global batch whatever dp (up to 4) is
        mine = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
        result = train_step(
            gpt_forward_step,
            [iter(mine) for _ in chunks],
            chunks,
            optimizer,
            num_microbatches=len(mine),
            groups=groups,
            lr_scheduler=scheduler,
        )
        losses.append(result.loss)
    return losses


def _weights(chunks, groups) -> dict[str, torch.Tensor]:
    """Every parameter of the model, whole, by its single-process name, on every rank."""
    mine = {}
    for chunk in chunks:
        model = chunk.module
        for name, p in model.named_parameters():
            ref = reference_name(model, name)
            vocab = VOCAB if ref in ("embedding.word_embeddings.weight", "output_weight") else None
            mine[ref] = full_tensor(p.data.clone(), p, groups.tp, vocab)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def _save(path, chunks, optimizer, scheduler, groups, iteration):
    return save_checkpoint(
        path,
        iteration,
        chunks,
        optimizer,
        groups=groups,
        lr_scheduler=scheduler,
        consumed_train_samples=iteration * 16,
        args={"note": "test"},
    )


RESHARD = [
    # saved under tp2 pp2 ... loaded under
    dict(tp=1, pp=4),
    dict(tp=1, pp=1, distributed_optimizer=True),  # dp 4, ZeRO-1
    dict(tp=1, pp=2, vpp=2),
    dict(tp=4, pp=1),
    dict(tp=1, pp=2, zero_stage=2),  # dp 2, ZeRO-2
    # the embedding and the loss counted in the split: chunks of 0, 1, 1, 1, 1, 0 layers
    dict(
        tp=1,
        pp=2,
        vpp=3,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ),
]


@pytest.mark.slow  # five layouts load and train: a checkpoint round trip stays fast below
@pytest.mark.parametrize("config", [{}, {"activation": "swiglu", "normalization": "RMSNorm"}])
@distributed(world_size=4, timeout=240)
def test_a_checkpoint_loads_under_any_layout(config):
    path = _shared_tmpdir()
    chunks, optimizer, scheduler, groups = _build(2, 2, **config)
    _train(chunks, optimizer, scheduler, groups, range(2))
    _save(path, chunks, optimizer, scheduler, groups, 2)
    saved = _weights(chunks, groups)
    expected = _train(chunks, optimizer, scheduler, groups, [2, 3])  # the second uses the moments
    ps.destroy_model_parallel()

    for layout in RESHARD:
        chunks, optimizer, scheduler, groups = _build(**layout, seed=SEED + 1, **config)
        info = load_checkpoint(path, chunks, optimizer, groups=groups, lr_scheduler=scheduler)
        assert info.iteration == 2 and info.consumed_train_samples == 32
        assert info.args == {"note": "test"} and not info.rng_restored  # other layout
        loaded = _weights(chunks, groups)
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (layout, name)
        assert scheduler.num_steps == 2
        losses = _train(chunks, optimizer, scheduler, groups, [2, 3])
        torch.testing.assert_close(losses, expected, **GPT_TOL, msg=f"{layout}")
        ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2, pp=2), dict(tp=2, pp=1, distributed_optimizer=True), dict(tp=1, pp=2, vpp=2)],
)
@pytest.mark.slow  # three runs each: saving and loading stay fast in one process below
@distributed(world_size=4, timeout=240)
def test_resume_equals_the_uninterrupted_run(layout):
    """With dropout on (RNG states matter) and a bf16 model (separate fp32 masters)."""
    config = dict(hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.bfloat16)
    path = _shared_tmpdir()
    whole = _train(*_build(**layout, **config), range(4))
    ps.destroy_model_parallel()

    chunks, optimizer, scheduler, groups = _build(**layout, **config)
    assert _train(chunks, optimizer, scheduler, groups, range(2)) == whole[:2]
    _save(path, chunks, optimizer, scheduler, groups, 2)
    ps.destroy_model_parallel()
    # a fresh start: another seed for the weights and every generator, then the checkpoint
    chunks, optimizer, scheduler, groups = _build(**layout, seed=SEED + 7, **config)
    torch.manual_seed(99)
    info = load_checkpoint(path, chunks, optimizer, groups=groups, lr_scheduler=scheduler)
    assert info.rng_restored
    rest = _train(chunks, optimizer, scheduler, groups, range(2, 4))
    assert rest == whole[2:]  # exactly


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@distributed(world_size=4, timeout=240)
def test_zero_checkpoint_loads_under_zero1_and_plain_data_parallel(stage):
    path = _shared_tmpdir()
    chunks, optimizer, scheduler, groups = _build(1, 1, zero_stage=stage)  # dp 4
    _train(chunks, optimizer, scheduler, groups, range(2))
    _save(path, chunks, optimizer, scheduler, groups, 2)
    expected = _train(chunks, optimizer, scheduler, groups, [2, 3])
    ps.destroy_model_parallel()
    targets = (  # dp 2, dp 2, dp 4
        dict(tp=2, pp=1, zero_stage=1),
        dict(tp=1, pp=2, zero_stage=0),
        dict(tp=1, pp=1, zero_stage=3),
    )
    for layout in targets:
        chunks, optimizer, scheduler, groups = _build(**layout, seed=SEED + 1)
        load_checkpoint(path, chunks, optimizer, groups=groups, lr_scheduler=scheduler)
        losses = _train(chunks, optimizer, scheduler, groups, [2, 3])
        torch.testing.assert_close(losses, expected, **GPT_TOL, msg=f"{layout}")
        ps.destroy_model_parallel()


@pytest.mark.slow
@distributed(world_size=4, timeout=240)
def test_loading_a_different_model_fails_clearly():
    path = _shared_tmpdir()
    chunks, optimizer, scheduler, groups = _build(2, 2)
    assert load_checkpoint(path, chunks, optimizer, groups=groups) is None  # nothing saved yet
    _save(path, chunks, optimizer, scheduler, groups, 1)
    ps.destroy_model_parallel()

    chunks, optimizer, _, groups = _build(2, 1, hidden_size=32)
    with pytest.raises(ValueError, match=r"different model shape.*\n.*hidden_size: checkpoint 16"):
        load_checkpoint(path, chunks, optimizer, groups=groups)
    ps.destroy_model_parallel()
    chunks, optimizer, _, groups = _build(1, 2, vocab_size=VOCAB + 3)
    with pytest.raises(ValueError, match="vocab_size: checkpoint 37, this model 40"):
        load_checkpoint(path, chunks, optimizer, groups=groups)
    ps.destroy_model_parallel()
    chunks, optimizer, _, groups = _build(1, 1, num_layers=2)
    with pytest.raises(ValueError, match="num_layers: checkpoint 4, this model 2"):
        load_checkpoint(path, chunks, optimizer, groups=groups)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(path, chunks, optimizer, groups=groups, iteration=5)


# --- atomic saves and safe loads (one process) ---------------------------------------------


def _single(seed=SEED):
    config = gpt_config(num_layers=2)
    (chunk,) = build_gpt_chunks(config, seed=seed)
    ddp = DistributedDataParallel(chunk)
    optimizer = Optimizer([ddp], lr=1e-2)
    return [ddp], optimizer, TrainGroups()


def _save_then_hang(path, ready):
    """Save iteration 1, then die while iteration 2 is being written (the parent kills us)."""
    chunks, optimizer, groups = _single()
    save_checkpoint(path, 1, chunks, optimizer, groups=groups)
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        future = write(self, plan, planner)
        future.wait()
        ready.set()
        signal.pause()

    FileSystemWriter.write_data = write_then_hang
    for p in chunks[0].module.parameters():
        p.data.add_(1.0)  # iteration 2's weights differ
    save_checkpoint(path, 2, chunks, optimizer, groups=groups)


@pytest.mark.slow  # spawns a fresh interpreter
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_save_then_hang, args=(str(tmp_path), ready))
    child.start()
    try:
        assert ready.wait(timeout=120), "the save did not reach its data files"
        assert any((tmp_path / "iter_0000002.partial").iterdir())  # data was being written
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(timeout=30)
    assert read_latest(tmp_path) == 1
    assert not iteration_dir(tmp_path, 2).exists()

    chunks, optimizer, groups = _single(seed=SEED + 1)
    info = load_checkpoint(tmp_path, chunks, optimizer, groups=groups)
    assert info.iteration == 1
    (saved,) = _single()[0]  # iteration 1 held the initial weights of SEED
    for mine, theirs in zip(chunks[0].module.parameters(), saved.module.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    # the next save clears the leftover and completes
    save_checkpoint(tmp_path, 2, chunks, optimizer, groups=groups)
    assert read_latest(tmp_path) == 2
    assert not (tmp_path / "iter_0000002.partial").exists()
    common = json.loads((iteration_dir(tmp_path, 2) / "common.json").read_text())
    assert common["iteration"] == 2 and common["layout"]["world_size"] == 1


def test_saving_the_same_iteration_again_replaces_it(tmp_path):
    chunks, optimizer, groups = _single()
    save_checkpoint(tmp_path, 3, chunks, optimizer, groups=groups)
    for p in chunks[0].module.parameters():
        p.data.fill_(0.5)
    save_checkpoint(tmp_path, 3, chunks, optimizer, groups=groups)
    fresh, fresh_optimizer, _ = _single(seed=SEED + 1)
    load_checkpoint(tmp_path, fresh, fresh_optimizer, groups=groups)
    assert all(torch.all(p == 0.5) for p in fresh[0].module.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


def test_model_only_load_needs_no_optimizer_state(tmp_path):
    chunks, _, groups = _single()
    save_checkpoint(tmp_path, 1, chunks, None, groups=groups)
    fresh, optimizer, _ = _single(seed=SEED + 1)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(tmp_path, fresh, optimizer, groups=groups)
    load_checkpoint(tmp_path, fresh, optimizer, groups=groups, load_optimizer=False)
    for mine, theirs in zip(
        fresh[0].module.parameters(), chunks[0].module.parameters(), strict=True
    ):
        assert torch.equal(mine, theirs)


# --- what pretrain_gpt.py's --load says (one process) ---------------------------------------


FLAGS = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--micro-batch-size 1 --lr 1e-2 --train-iters 10 --use-default-corpus"
)


def _config(extra: str):
    return config_from_flags(shlex.split(f"{FLAGS} {extra}"), world_size=1)


def test_load_flags_name_flags_not_python_arguments(tmp_path):
    chunks, _, groups = _single()
    save_checkpoint(tmp_path, 1, chunks, None, groups=groups)  # a model-only checkpoint
    fresh, optimizer, _ = _single(seed=SEED + 1)
    setup = TrainingSetup(fresh, optimizer, None, groups)
    with pytest.raises(ArgumentsError, match="holds no optimizer state; pass --no-load-optim") as e:
        training_checkpoints.load(_config(f"--load {tmp_path}"), setup)
    assert "load_optimizer" not in str(e.value)
    assert (
        training_checkpoints.load(_config(f"--load {tmp_path} --no-load-optim"), setup).iteration
        == 1
    )

    schedule = _schedule(optimizer)
    save_checkpoint(tmp_path, 2, fresh, optimizer, groups=groups, lr_scheduler=schedule)
    setup.scheduler = _schedule(optimizer, max_lr=2e-2)
    mismatch = r"--lr: saved 0.01, now 0.02.*pass --use-checkpoint-opt_param-scheduler"
    with pytest.raises(ArgumentsError, match=mismatch) as e:
        training_checkpoints.load(_config(f"--load {tmp_path}"), setup)
    assert "settings=" not in str(e.value)
    training_checkpoints.load(_config(f"--load {tmp_path} --override-opt_param-scheduler"), setup)
    assert (setup.scheduler.max_lr, setup.scheduler.num_steps) == (2e-2, 0)  # flags' schedule
    nowhere = tmp_path / "nowhere"
    with pytest.raises(ArgumentsError, match="the directory does not exist"):
        training_checkpoints.load(_config(f"--load {nowhere}"), setup)
    # a job that saves and resumes in one place starts fresh
    assert (
        training_checkpoints.load(_config(f"--load {nowhere} --save {nowhere}"), setup).iteration
        == 0
    )


def _schedule(optimizer, max_lr=1e-2):
    return LRScheduler(
        optimizer, max_lr=max_lr, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="linear"
    )
