"""One training iteration, whole: zero, forward/backward over the pipeline, finalize, step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megapp import comm
from megapp.distributed.ddp import DistributedDataParallel, finalize_model_grads
from megapp.optimizer.optimizer import Optimizer
from megapp.parallel_state import TrainGroups
from megapp.pipeline_parallel.compute import ForwardStepFunc, PipelineHooks
from megapp.pipeline_parallel.engine import forward_backward
from megapp.pipeline_parallel.schedules import Schedule


@dataclass
class TrainStepResult:
    """The iteration's figures, identical on every rank."""

    loss: float
    """Mean loss over the microbatches and data-parallel replicas (unscaled)."""
    grad_norm: float
    """Global gradient norm before clipping (nan when the step was skipped)."""
    skipped: bool
    """True when inf/nan gradients made the loss scaler skip the update."""
    events: list = field(default_factory=list)
    """This rank's pipeline timeline, when recording was asked for."""
    moe_losses: dict = field(default_factory=dict)
    """A mixture-of-experts model's auxiliary losses without their coefficients
    (``load_balancing_loss``, ``z_loss``, ...), averaged over the microbatches, the layers
    and the data-parallel replicas, and the expert load of the step's tokens
    (``expert_load_max``, ``expert_load_min``: see :func:`moe_losses`); empty for a dense
    model."""


def _scaled(forward_step_func: ForwardStepFunc, scale: float) -> ForwardStepFunc:
    """Multiply every microbatch loss by the loss scale, so backward runs on scaled values."""

    def step(iterator, chunk, inputs):
        output, loss_func = forward_step_func(iterator, chunk, inputs)
        if loss_func is None:
            return output, None

        def scaled_loss(out):
            loss = loss_func(out)
            return (loss[0] if isinstance(loss, tuple) else loss) * scale

        return output, scaled_loss

    return step


_MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def moe_model_config(chunks: Sequence):
    """The model config of ``chunks`` when the model has experts, else None."""
    configs = [getattr(chunk.module, "config", None) for chunk in chunks]
    return next((c for c in configs if getattr(c, "num_moe_experts", None)), None)


def routed_tokens(chunks: Sequence, groups: TrainGroups) -> list[tuple[nn.Module, torch.Tensor]]:
    """Every mixture-of-experts layer of this rank with the pairs its router sent to each
    expert since the last call ``[E]``, summed over tp × cp × dp (Megatron-Core's
    tensor-and-data-parallel group with context): the ranks that route different tokens
    with the same router, tp included because sequence parallelism gives each tp rank its
    own tokens. The routers start counting again. Collective over those ranks, which hold
    the same layers; nothing for a dense model."""
    if moe_model_config(chunks) is None:  # a dense model: no module walk every step
        return []
    layers = [
        module
        for chunk in chunks
        for module in chunk.modules()
        if hasattr(getattr(module, "router", None), "take_tokens_per_expert")
    ]
    if not layers:
        return []
    counts = torch.stack([layer.router.take_tokens_per_expert() for layer in layers])
    for group in (groups.tp_cp, groups.dp):  # tp × cp, then over dp: the sum over all three
        if comm.world_size(group) > 1:
            comm.all_reduce(counts, group)
    return list(zip(layers, counts, strict=True))


def update_expert_biases(routed: Sequence[tuple[nn.Module, torch.Tensor]]) -> None:
    """Move every router's expert bias by the counts of :func:`routed_tokens`; nothing for
    a layer without expert bias."""
    for layer, counts in routed:
        if layer.router.expert_bias is not None:
            layer.router.step_expert_bias(counts)


def moe_losses(
    chunks: Sequence, groups: TrainGroups, routed: Sequence[tuple[nn.Module, torch.Tensor]] = ()
) -> dict[str, float]:
    """Every mixture-of-experts layer's auxiliary losses, averaged over the step's
    microbatches, the layers and data-parallel replicas (a collective over every rank of a
    mixture-of-experts model; nothing for a dense one). A balancing loss is a share on each
    rank of a sequence (they add up to the sequence's); a z-loss is the rank's own mean.

    With the counts of :func:`routed_tokens`, also the expert load: ``expert_load_max``,
    the largest of every layer's busiest expert's count over the mean count (1 is even,
    ``E / k`` the worst), and ``expert_load_min``, the smallest of every layer's idlest
    expert's count over the mean."""
    config = moe_model_config(chunks)
    if config is None:
        return {}
    n, layers = len(_MOE_LOSSES), config.num_layers
    # the losses, whether each was computed, then each layer's (max, min) load: layer l's
    # from one rank of its stage, 0 from every other, so the sum is that rank's figure
    sums = torch.zeros(2 * n + 2 * layers, dtype=torch.float64)
    for chunk in chunks:
        for module in chunk.modules():
            if not hasattr(module, "mean_losses"):
                continue
            for name, value in module.mean_losses().items():
                if name in _MOE_LOSSES:
                    sums[_MOE_LOSSES.index(name)] += float(value)
                    sums[n + _MOE_LOSSES.index(name)] = 1.0
    if comm.rank(groups.tp_cp) == 0 and comm.rank(groups.dp) == 0:
        for layer, counts in routed:
            counts = counts.double()
            if counts.sum() > 0:
                mean = counts.sum() / counts.numel()
                sums[2 * n + 2 * layer.layer_number] = counts.max() / mean
                sums[2 * n + 2 * layer.layer_number + 1] = counts.min() / mean
    if torch.distributed.is_initialized():
        comm.all_reduce(sums, torch.distributed.group.WORLD)
    moe_layers = sum(config.is_moe_layer(i) for i in range(layers))
    dp = comm.world_size(groups.dp)
    shares = {"z_loss": dp * comm.world_size(groups.tp_cp)}
    result = {
        name: float(sums[i]) / (moe_layers * shares.get(name, dp))
        for i, name in enumerate(_MOE_LOSSES)
        if sums[n + i] > 0
    }
    loads = sums[2 * n :].view(layers, 2)
    loads = loads[loads[:, 0] > 0]  # the layers that routed tokens (max ≥ 1 there)
    if len(loads):
        result["expert_load_max"] = float(loads[:, 0].max())
        result["expert_load_min"] = float(loads[:, 1].min())
    return result


def set_aux_loss_scale(chunks: Sequence, scale: float) -> None:
    """Give every mixture-of-experts layer's auxiliary losses the gradient ``scale`` in
    backward, and start its sums of them (layers with an ``aux_loss_scale``; dense models
    have none)."""
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "aux_loss_scale"):
                module.aux_loss_scale = scale
                module.reset_loss_sums()


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterators: Iterator | Sequence[Iterator],
    chunks: Sequence[DistributedDataParallel],
    optimizer: Optimizer,
    *,
    num_microbatches: int,
    groups: TrainGroups,
    schedule: str | Schedule | None = None,
    lr_scheduler=None,
    tensor_shapes=None,
    record: bool = False,
) -> TrainStepResult:
    """Run one iteration and update the model.

    ``forward_step_func(data_iterator, chunk, inputs) -> (output, loss_func)`` as for
    :func:`megapp.pipeline_parallel.forward_backward`; ``chunk`` is the
    DistributedDataParallel wrapper (call it like the model). The schedule (a name or a
    :class:`~megapp.pipeline_parallel.schedules.Schedule`) defaults to the catalog's
    default for the number of chunks (1F1B, interleaved with several); chunk ``c`` must be
    built for the virtual stage the schedule places there. ``record`` keeps this rank's
    pipeline timeline in the result.
    """
    for chunk in chunks:
        if chunk.dp_size != comm.world_size(groups.dp_cp):
            raise ValueError(
                f"groups.dp_cp has {comm.world_size(groups.dp_cp)} ranks but the model chunk is "
                f"replicated over {chunk.dp_size}; use TrainGroups.from_parallel_state()"
            )
        chunk.zero_grad_buffer()
    scaler = optimizer.grad_scaler
    scale = float(scaler.scale) if scaler is not None else 1.0
    step_func = _scaled(forward_step_func, scale) if scaler is not None else forward_step_func
    # The auxiliary losses are scaled as the main loss is: by the loss scale, averaged over
    # the microbatches; a sequence's ranks' losses add up to the sequence's, and the dp × cp
    # mean divides by cp, which the factor cp undoes.
    set_aux_loss_scale(chunks, scale * comm.world_size(groups.cp) / num_microbatches)
    hooks = PipelineHooks(
        before_backward=lambda c, is_last: chunks[c].set_grad_sync(is_last),
        after_backward=lambda c: chunks[c].settle_grads(),
    )
    result = forward_backward(
        step_func,
        data_iterators,
        list(chunks),
        num_microbatches,
        schedule=schedule,
        pp_group=groups.pp,
        channels=groups.pp_channels,
        tensor_shapes=tensor_shapes,
        hooks=hooks,
        record=record,
    )
    # with the first and last stage on one rank (a V), the tied embedding is summed there
    embedding_group = None if result.schedule.ends_on_one_rank else groups.embedding
    finalize_model_grads(chunks, tp_group=groups.tp, embedding_group=embedding_group)
    routed = routed_tokens(chunks, groups)
    update_expert_biases(routed)  # once per step, after the gradients, as Megatron-Core
    stepped = optimizer.step()
    if stepped.updated and lr_scheduler is not None:
        lr_scheduler.step()
    aux = moe_losses(chunks, groups, routed)
    loss = result.loss.detach().double().reshape(1) / scale
    if comm.world_size(groups.dp_cp) > 1:  # each cp rank's loss is cp × its share
        comm.all_reduce(loss, groups.dp_cp)
        loss /= comm.world_size(groups.dp_cp)
    return TrainStepResult(
        float(loss.item()), stepped.grad_norm, not stepped.updated, result.events, aux
    )
