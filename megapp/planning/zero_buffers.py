"""What ZeRO-2's gradient scratch and ZeRO-3's gathered weights add to a rank's memory, and
when: the buffers of :mod:`megapp.distributed.sharded_grads` and
:mod:`megapp.distributed.sharded_params`, counted per chunk.

- **Gradient scratch** (ZeRO-2 and 3): a bucket's fp32 gradient exists whole from its first
  gradient of a microbatch until its next first gradient (the next microbatch's, or the end
  of the step), while its reduce-scatter runs; its output, one ``1/dp`` slice, lives as
  long. So from a chunk's first backward of the step to the end of the backward, every
  regular bucket of the chunk holds its whole gradient and a slice in flight. The tied
  embedding's copies, summed with each other first, are whole for the step (counted in
  the model state).
- **The reduction waited on**: a bucket's next first gradient waits for its previous
  reduce-scatter; gloo keeps a copy of the bucket for it until then (NCCL none).
- **Gathered weights** (ZeRO-3): a layer's weights are gathered whole for its forward and
  again for its backward, with the next layer's prefetched (the previous one's in
  backward). The chunk's other weights (embedding, final norm, output layer) are gathered
  around its forward and kept until their gradients are in: through the whole backward
  for the embedding's chunk, until the output layer's backward for the last chunk. The
  rank's own slices of the weights are a store of their own, in the model state.

The optimizer step comes after all of it is freed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapp.models.gpt import GPTConfig
from megapp.planning.model_state import (
    chunk_expert_parameters,
    chunk_parameters,
    expert_parameters,
    layer_parameters,
)

GRAD_BYTES = 4  # the gradient buffers' fp32


@dataclass(frozen=True)
class ZeroBuffers:
    """Bytes a chunk's ZeRO buffers hold on one rank (0 where the stage has none)."""

    reducing: float  # from its first backward of the step on: whole gradients and slices
    waited: float  # at a bucket's next first gradient, beside ``reducing``: gloo's copy
    gathered_forward: float  # ZeRO-3 weights whole during one of its forwards
    gathered_backward: float  # and during one of its backwards
    gathered_kept: float  # and while any microbatch is between its forward and backward

    @staticmethod
    def none() -> ZeroBuffers:
        return ZeroBuffers(0.0, 0.0, 0.0, 0.0, 0.0)


def late_parameters(config: GPTConfig, stage: int, num_stages: int) -> int:
    """The tied word embedding's parameters on virtual stage ``stage``: the first stage's
    embedding and the last one's copy for the output layer have their gradients summed
    with each other before the data-parallel reduction, so they stay whole for the step."""
    first, last = stage == 0, stage == num_stages - 1
    if not config.share_embeddings_and_output_weights or first == last:
        return 0
    return config.padded_vocab_size // config.tensor_model_parallel_size * config.hidden_size


def chunk_zero_buffers(
    config: GPTConfig,
    stage: int,
    num_stages: int,
    num_layers: int,
    *,
    dp: int,
    edp: int,
    zero: int,
    gloo: bool,
    bucket_size: int | None,
) -> ZeroBuffers:
    """:class:`ZeroBuffers` of virtual stage ``stage`` (of ``num_stages``, ``num_layers``
    layers) under ZeRO stage ``zero`` over ``dp`` ranks (its experts over ``edp``), with
    buckets of ``bucket_size`` elements (None: one per unit of the chunk)."""
    if zero < 2:
        return ZeroBuffers.none()
    params = chunk_parameters(config, stage, num_stages, num_layers)
    experts = chunk_expert_parameters(config, num_layers)
    regular = params - experts - late_parameters(config, stage, num_stages)
    reducing, largest = 0.0, 0
    for size, ranks, unit in (
        (regular, dp, layer_parameters(config) - expert_parameters(config)),
        (experts, edp, expert_parameters(config)),
    ):
        if ranks > 1 and size:
            reducing += GRAD_BYTES * size * (1 + 1 / ranks)
            bucket = unit if zero == 3 else size  # ZeRO-3's buckets never span two layers
            largest = max(largest, bucket if bucket_size is None else min(bucket, bucket_size))
    waited = GRAD_BYTES * largest if gloo else 0.0
    if zero < 3 or dp == 1:
        return ZeroBuffers(reducing, waited, 0.0, 0.0, 0.0)
    w = config.params_dtype.itemsize
    layers = min(2, num_layers) * layer_parameters(config) * w  # in use and prefetched
    outer = (params - num_layers * layer_parameters(config)) * w
    first, last = stage == 0, stage == num_stages - 1
    kept = outer if first else 0.0
    backward = layers + kept if first or not last else max(layers, outer)
    return ZeroBuffers(reducing, waited, layers + outer, backward, kept)
