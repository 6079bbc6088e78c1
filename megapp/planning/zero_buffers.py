"""What ZeRO-2's gradient scratch and ZeRO-3's gathered weights add to a rank's memory, and
when: the buffers of :mod:`megapp.distributed.sharded_grads` and
:mod:`megapp.distributed.sharded_params`, counted per chunk.

- **Gradient scratch** (ZeRO-2 and 3): a bucket's fp32 gradient exists whole from its first
  gradient of a microbatch while the backward fills it and its reduce-scatter runs; its
  output, one ``1/dp`` slice, lives as long. The reduction is settled (the scratch freed)
  when the next bucket's starts and at the end of the backward, so within a whole
  backward (``B``) at most two buckets are whole and one slice is in flight, and none
  outside it. Under a split backward a bucket is complete only once ``W`` has run, and
  ``I``'s gradients of the next microbatches start it anew: from a chunk's first backward
  of the step on, every regular bucket of the chunk holds its whole gradient, and the end
  of a ``W`` waits for the slices.
  The tied embedding's copies, summed with each other first, are whole for the step
  (counted in the model state).
- **The reduction waited on**: a backward's end, or a bucket's next first gradient, waits
  for a reduce-scatter; gloo keeps a copy of the bucket for it until then (NCCL none).
- **Gathered weights** (ZeRO-3): a layer's weights are gathered whole for its forward and
  again for its backward, with the next layer's prefetched (the previous one's in
  backward). The chunk's other weights (embedding, final norm, output layer) are gathered
  around its forward and kept until their gradients are in: through the whole backward
  for the embedding's chunk, until the output layer's backward for the last chunk. A
  split backward's ``I`` defers the weights' gradients, so they stay gathered until
  ``W``: the whole chunk, from a microbatch's ``I`` to its ``W``. The rank's own slices
  of the weights are a store of their own, in the model state.

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

    reducing: float  # under a split backward, from its first backward of the step on
    slices: float  # and the slices its reductions make, while they run
    during: float  # a whole backward's buckets and gathered weights at its fullest
    settled: float  # and where it waits for a reduction, with gloo's copy
    settles_inside: bool  # that wait is between two buckets (else at the backward's end)
    waited: float  # where a reduction is waited on, beside the buckets: gloo's copy
    gathered_forward: float  # ZeRO-3 weights whole during one of its forwards
    gathered_backward: float  # and during one of its backwards
    gathered_kept: float  # and while any microbatch is between its forward and backward
    gathered_split: float = 0.0  # all of them from a split backward's I to its W

    @staticmethod
    def none() -> ZeroBuffers:
        return ZeroBuffers(0.0, 0.0, 0.0, 0.0, False, 0.0, 0.0, 0.0, 0.0)


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
    reducing = slices = largest = 0
    whole = []  # per group: one bucket's whole gradient, its slice, and whether several
    for size, ranks, unit in (
        (regular, dp, layer_parameters(config) - expert_parameters(config)),
        (experts, edp, expert_parameters(config)),
    ):
        if ranks > 1 and size:
            reducing += GRAD_BYTES * size
            slices += GRAD_BYTES * size / ranks
            bucket = unit if zero == 3 else size  # ZeRO-3's buckets never span two layers
            bucket = bucket if bucket_size is None else min(bucket, bucket_size)
            whole.append((GRAD_BYTES * bucket, GRAD_BYTES * bucket / ranks, bucket < size))
            largest = max(largest, bucket)
    waited = GRAD_BYTES * largest if gloo else 0.0
    first, last = stage == 0, stage == num_stages - 1
    if zero < 3 or dp == 1:
        # one bucket filling, then the next one beside it and its slice in flight
        during = sum(b + (b + sl if several else 0) for b, sl, several in whole)
        settled = sum(b * (2 if several else 1) + sl for b, sl, several in whole) + waited
        inside = any(several for _, _, several in whole)
        return ZeroBuffers(reducing, slices, during, settled, inside, waited, 0.0, 0.0, 0.0)
    w = config.params_dtype.itemsize
    layer = layer_parameters(config) * w
    layers = min(2, num_layers) * layer  # in use and prefetched
    outer = (params - num_layers * layer_parameters(config)) * w
    kept = outer if first else 0.0
    backward = layers + kept if first or not last else max(layers, outer)
    # A whole backward goes layer by layer: the k-th gathered with the next one prefetched
    # (none after the chunk's first layer), its bucket filling beside the previous bucket
    # reducing (the head's before the last chunk's first layer). A bucket's reduction is
    # waited for once the next one is complete, the weights of the layer that completed
    # it already freed; gloo holds a copy of the bucket it waits for.
    grads, grad_slice = whole[0][:2] if whole else (0.0, 0.0)
    share = grad_slice / grads if grads else 0.0
    dense_layer = layer_parameters(config) - expert_parameters(config)
    head_grads = GRAD_BYTES * (regular - num_layers * dense_layer) if last else 0.0
    filling, waiting = [], []  # per position: bytes filling, and where a reduction is waited
    for k in sorted({0, min(1, num_layers - 1), num_layers - 1} if num_layers else set()):
        previous = grads if k > 0 else head_grads
        next_layer = layer if k < num_layers - 1 else 0.0
        reducing_previous = previous * (1 + share)
        filling.append(layer + next_layer + grads + reducing_previous)
        if previous:
            copy = previous if gloo else 0.0
            waiting.append(next_layer + grads + reducing_previous + copy)
    head = outer + layer + head_grads if last else 0.0  # the output layer's backward
    during = max([kept + f for f in filling] + [head])
    inside = bool(waiting)
    settled = kept + max(waiting) if inside else grads * (1 + share) + waited
    split = num_layers * layer + outer  # gathered from a split backward's I to its W
    return ZeroBuffers(
        reducing, slices, during, settled, inside, waited, layers + outer, backward, kept, split
    )
