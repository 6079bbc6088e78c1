"""GPTModel against plain torch ops, and the training step's data-parallel and precision
machinery: overlap and no-sync, ZeRO-1 memory, bf16 masters, fp16 skipped steps, bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapp import parallel_state as ps
from megapp.distributed import DistributedDataParallel
from megapp.models import GPTModel, build_gpt_chunks
from megapp.optimizer import DynamicGradScaler, Optimizer
from megapp.pipeline_parallel import PipelineHooks, forward_backward
from megapp.testing import distributed
from megapp.testing.plain_gpt import plain_layer
from megapp.testing.plain_gpt import plain_norm as _norm
from megapp.training import TrainGroups, train_step
from tests.support import SEED, VOCAB, global_batch, gpt_config, gpt_forward_step, masked_mean


@pytest.mark.parametrize("positions", ["learned_absolute", "rope"])
@pytest.mark.parametrize("tied", [True, False])
def test_gpt_model_equals_plain_torch(positions, tied):
    """The single-process GPTModel computes embedding, layers, norm, logits and loss
    exactly as plain torch ops do (float64: the two differ only in op order)."""
    config = gpt_config(
        position_embedding_type=positions,
        share_embeddings_and_output_weights=tied,
        params_dtype=torch.float64,
        num_layers=3,
    )
    model = GPTModel(config, seed=SEED)
    tokens, labels, _ = global_batch(0, 1)[0]
    loss = model(tokens, labels=labels)

    x = F.embedding(tokens.t(), model.embedding.word_embeddings.weight)
    freqs = None
    if positions == "learned_absolute":
        x = x + model.embedding.position_embeddings.weight[: tokens.shape[1], None, :]
    else:
        from megapp.fusions.rope import rotary_freqs

        freqs = rotary_freqs(tokens.shape[1], config.kv_channels).double()
    for layer in model.decoder.layers:
        x = plain_layer(layer, x, config, freqs)
    x = _norm(x, model.decoder.final_layernorm, config.normalization, config.layernorm_epsilon)
    out_weight = model.embedding.word_embeddings.weight if tied else model.output_weight
    logits = x @ out_weight.t()
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.view(-1, tokens.shape[0]).t(), rtol=1e-10, atol=1e-12)
    # tied means the same tensor, untied a distinct one drawn from its own seed
    assert (model.output_weight is None) == tied


def test_same_seed_same_model_under_any_split():
    """A layer's weights depend on its index and the seed, not on the chunk that builds it."""
    config = gpt_config()
    whole = dict(GPTModel(config, seed=SEED).named_parameters())
    chunks = build_gpt_chunks(config, pp_rank=1, pp_size=2, vpp_size=2, seed=SEED)
    for chunk in chunks:  # virtual stages 1 and 3: layers 2-3 and 6-7
        for name, p in chunk.named_parameters():
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number)
                name = ".".join(parts)
            elif name == "output_weight":  # last stage's copy of the word embedding
                name = "embedding.word_embeddings.weight"
            torch.testing.assert_close(p, whole[name], rtol=0, atol=0)
    assert chunks[1].output_weight.shared and chunks[1].output_weight.shared_embedding


def test_bad_layouts_and_configs_fail_clearly():
    config = gpt_config()  # 8 layers
    with pytest.raises(
        ValueError, match=r"num_layers \(8\) is not divisible by .* \(3\); use 6 or 9"
    ):
        build_gpt_chunks(config, pp_rank=0, pp_size=3)
    with pytest.raises(ValueError, match=r"2 × 3 = 6"):
        build_gpt_chunks(config, pp_rank=0, pp_size=2, vpp_size=3)
    chunks = build_gpt_chunks(config, pp_rank=2, pp_size=3, first_stage_layers=2)
    assert [layer.layer_number for layer in chunks[0].decoder.layers] == [5, 6, 7]
    with pytest.raises(ValueError, match="tensor-parallel group has 1 ranks"):
        GPTModel(gpt_config(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        gpt_config(vocab_size=0)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        GPTModel(config)(torch.zeros(1, 2 * config.max_position_embeddings, dtype=torch.long))


def _dp_model(
    distributed_optimizer=False,
    bucket_size=500,
    shard_grads=False,
    shard_params=False,
    overlap_grad_reduce=True,
    **config,
):
    ps.initialize_model_parallel(1, 1)
    groups = TrainGroups.from_parallel_state()
    model = GPTModel(gpt_config(num_layers=2, **config), seed=SEED)
    ddp = DistributedDataParallel(
        model,
        dp_group=groups.dp,
        bucket_size=bucket_size,
        zero_stage=3 if shard_params else 2 if shard_grads else int(distributed_optimizer),
        overlap_grad_reduce=overlap_grad_reduce,
    )
    return ddp, groups


@distributed(world_size=2)
def test_buckets_reduce_during_the_last_backward_only():
    ddp, groups = _dp_model()
    assert len(ddp.buffer.buckets) > 2
    in_flight = []  # buckets whose reduction has started, seen before each backward

    def before_backward(chunk, last):
        in_flight.append(sum(b.work is not None for b in ddp.buffer.buckets))
        ddp.set_grad_sync(last)

    ddp.zero_grad_buffer()
    batch = global_batch(0, 2)[dist.get_rank() :: 2][:3]
    hooks = PipelineHooks(before_backward=before_backward)
    forward_backward(gpt_forward_step, iter(batch), ddp, 3, pp_group=groups.pp, hooks=hooks)
    # none started during the first two backwards; every one during the third (the last),
    # before forward_backward returned, i.e. overlapped with that backward
    assert in_flight == [0, 0, 0]
    assert all(b.work is not None for b in ddp.buffer.buckets)
    ddp.finish_grad_sync()
    # and the reduced gradient is the data-parallel mean of the accumulated ones
    local = _local_grads(batch)
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g /= 2
    for p, want in zip(ddp.module.parameters(), mean, strict=True):
        torch.testing.assert_close(p.main_grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
@distributed(world_size=2)
def test_without_overlap_the_buckets_reduce_after_the_backward(distributed_optimizer):
    """``overlap_grad_reduce=False`` (``--no-overlap-grad-reduce``): no bucket starts during
    any backward; finish_grad_sync reduces them all to the data-parallel mean."""
    ddp, groups = _dp_model(distributed_optimizer, overlap_grad_reduce=False)
    ddp.zero_grad_buffer()
    batch = global_batch(0, 2)[dist.get_rank() :: 2][:3]
    hooks = PipelineHooks(before_backward=lambda chunk, last: ddp.set_grad_sync(last))
    forward_backward(gpt_forward_step, iter(batch), ddp, 3, pp_group=groups.pp, hooks=hooks)
    assert all(b.work is None for b in ddp.buffer.buckets)
    ddp.finish_grad_sync()
    local = _local_grads(batch)
    for p, grad in zip(ddp.module.parameters(), local, strict=True):
        dist.all_reduce(grad)
        torch.testing.assert_close(ddp.reduced_grad(p), grad / 2, rtol=1e-5, atol=1e-7)


def _local_grads(batch):
    model = GPTModel(gpt_config(num_layers=2), seed=SEED)
    loss = sum(masked_mean(model(t, labels=lab), m) for t, lab, m in batch) / len(batch)
    loss.backward()
    return [p.grad for p in model.parameters()]


@distributed(world_size=4)
def test_distributed_optimizer_keeps_one_dp_th_of_the_state():
    sizes = {}
    for sharded in (False, True):
        ddp, groups = _dp_model(distributed_optimizer=sharded)
        optimizer = Optimizer([ddp], lr=1e-3)
        batch = global_batch(0, 4)[dist.get_rank() :: 4]
        result = train_step(
            gpt_forward_step, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups
        )
        assert not result.skipped
        sizes[sharded] = optimizer.state_bytes()
        ps.destroy_model_parallel()
    numel = sum(p.numel() for p in GPTModel(gpt_config(num_layers=2)).parameters())
    assert sizes[False] == 2 * 4 * numel  # exp_avg and exp_avg_sq in fp32, masters are the model
    total = torch.tensor([sizes[True]])
    dist.all_reduce(total)
    assert total.item() == sizes[False]  # the shards cover every element exactly once
    assert sizes[True] <= sizes[False] / 4 + 2 * 4 * 4 * len(ddp.buffer.buckets)  # + padding


@pytest.mark.slow  # four train steps
@distributed(world_size=2)
def test_bf16_model_steps_fp32_masters():
    ddp, groups = _dp_model(params_dtype=torch.bfloat16)
    optimizer = Optimizer([ddp], lr=1e-2)
    assert all(s.master.dtype == torch.float32 for s in optimizer.slices)
    losses = []
    batch = global_batch(0, 2)[dist.get_rank() :: 2]
    for _ in range(4):  # the same batch again: the loss must fall
        result = train_step(
            gpt_forward_step, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups
        )
        losses.append(result.loss)
    assert losses[-1] < losses[0]
    for s in optimizer.slices:  # the model holds its masters rounded to bf16
        assert s.param.dtype == torch.bfloat16
        flat = s.param.data.view(-1)[s.lo : s.hi]
        torch.testing.assert_close(flat, s.master.to(torch.bfloat16), rtol=0, atol=0)
    # masters (4 bytes) come on top of Adam's 8 bytes per element
    numel = sum(p.numel() for p in ddp.module.parameters())
    assert optimizer.state_bytes() == 12 * numel


# fast: ZeRO-3 (the weights gathered around the skipped step)
@pytest.mark.parametrize(
    "stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]
)
@distributed(world_size=2)
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    ddp, groups = _dp_model(
        params_dtype=torch.float16, shard_grads=stage >= 2, shard_params=stage == 3
    )
    scaler = DynamicGradScaler(initial_scale=2.0**12, hysteresis=1)
    optimizer = Optimizer([ddp], lr=1e-2, grad_scaler=scaler)
    batch = global_batch(0, 2)[dist.get_rank() :: 2]
    poison = {"on": False}

    def step_func(iterator, chunk, inputs):
        output, loss_func = gpt_forward_step(iterator, chunk, inputs)
        if poison["on"] and dist.get_rank() == 1:  # one rank's gradient overflows
            return output, lambda out: loss_func(out) * float("inf")
        return output, loss_func

    first = train_step(step_func, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups)
    assert not first.skipped and math.isfinite(first.loss)
    with ddp.full_weights():
        before = torch.cat([p.data.flatten() for p in ddp.buffer.params])
    poison["on"] = True
    skipped = train_step(
        step_func, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups
    )
    assert skipped.skipped and skipped.grad_norm != skipped.grad_norm  # nan
    with ddp.full_weights():
        after = torch.cat([p.data.flatten() for p in ddp.buffer.params])
    assert torch.equal(after, before)  # nothing moved
    assert scaler.scale_value == 2.0**11  # backed off once
    poison["on"] = False
    again = train_step(step_func, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups)
    assert not again.skipped and again.loss < first.loss + 0.5


def test_config_roundtrip_is_plain():
    # dataclasses.replace keeps validation: sequence parallel without tp still fails
    with pytest.raises(ValueError, match="sequence_parallel needs"):
        dataclasses.replace(gpt_config(), sequence_parallel=True)


@pytest.mark.slow  # 16-bit ZeRO-3 stays fast in test_fp16_overflow_skips_the_step_on_every_rank
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@distributed(world_size=2)
def test_zero2_and_3_train_16_bit_models_like_zero1(dtype, stage):
    """ZeRO-2/3 and ZeRO-1 hold the same fp32 masters and AdamW states; their gradients
    differ only in where the division by dp happens (per microbatch or once), so the runs
    agree to the 16-bit rounding of the weights."""
    runs = {}
    for sharded in (False, True):
        ddp, groups = _dp_model(
            distributed_optimizer=True,
            shard_grads=sharded,
            shard_params=sharded and stage == 3,
            params_dtype=dtype,
        )
        scaler = DynamicGradScaler(initial_scale=2.0**10) if dtype == torch.float16 else None
        optimizer = Optimizer([ddp], lr=1e-2, grad_scaler=scaler)
        losses = []
        for step in range(3):
            batch = global_batch(step, 2)[dist.get_rank() :: 2]
            result = train_step(
                gpt_forward_step, iter(batch), [ddp], optimizer, num_microbatches=4, groups=groups
            )
            assert not result.skipped
            losses.append(result.loss)
        with ddp.full_weights():
            runs[sharded] = (
                losses,
                torch.cat([p.data.float().flatten() for p in ddp.buffer.params]),
            )
        ps.destroy_model_parallel()
    (losses1, params1), (losses2, params2) = runs[False], runs[True]
    torch.testing.assert_close(losses2, losses1, rtol=2e-3, atol=0)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(params2, params1, rtol=ulp, atol=1e-3 * ulp)
