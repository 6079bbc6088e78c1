"""Peak memory per pipeline rank of a layout, predicted from shapes and the schedule.

For each pipeline rank (tensor- and data-parallel ranks of one stage hold the same), with
``w`` bytes per element of the model's dtype, ``s``/``b`` the sequence and micro-batch,
``t`` the tensor-parallel size and ``V`` the padded vocabulary:

- **model state** (:mod:`megapp.planning.model_state`): weights, fp32 gradients, optimizer
  states, sharded by the ZeRO stage;
- **held activations**: what one microbatch's forward through a chunk leaves for its
  backward (:func:`chunk_activation_bytes`), summed over the microbatches the schedule has
  in flight at each moment. The rank's actions are walked in order (memory depends on the
  order alone, not on timing): a forward adds its chunk's bytes, a backward removes them,
  a split backward's ``I`` and ``W`` remove theirs in two parts;
- **working memory** of the action running at that moment (:func:`chunk_working_bytes`):
  a forward's temporaries and the output waiting to be sent, a backward's gradients of one
  layer's activations and weights (:mod:`megapp.planning.layer_working`), the output
  layer's logit gradients;
- **ZeRO-2/3 buffers** (:mod:`megapp.planning.zero_buffers`): a chunk's buckets filling
  and reducing during its backward, and where it waits for a reduction gloo's copy of the
  bucket; under a split backward each chunk's whole gradients from its first backward
  on (and at the end of a ``W`` the slices and the copy); ZeRO-3's gathered weights;
- **pipeline messages** alive during the action, read off the runner's plan
  (:mod:`megapp.planning.message_buffers`): receives posted ahead or waiting, and on gloo
  the sends kept until proven delivered;

and the peak is the state plus the largest held + working sum over the rank's actions, or,
on gloo (CPU), the optimizer step's temporaries after the backward where they are larger
(:func:`optimizer_step_bytes`; the fused CUDA optimizer allocates none). Which transport a
run uses is the hardware profile's for a plan, else the config's
(:func:`runs_on_gloo`); a run on gloo runs on CPUs, where context-parallel attention's
blocks are fused.
Every term is a count of the tensors megapp's layers create (measured, on CPU, by
:class:`~megapp.training.live_memory.LiveTensorMemory`; see docs/planning.md).

Under context parallelism every rank holds ``s/cp`` tokens of each sequence: the
activation and working terms are those of ``s/cp`` tokens, with attention's own
(:func:`~megapp.planning.activations.context_parallel_attention_bytes` held,
:func:`~megapp.planning.attention_working.attention_working_bytes` while it runs);
weights are replicated over the cp ranks and ZeRO shards over the ``dp × cp`` ranks that
reduce the gradients.

A mixture-of-experts model's experts shard their optimizer states over the expert-data-
parallel ranks (world / (etp·ep·pp)); its layers keep the routed rows' activations
(:func:`~megapp.planning.activations.moe_activation_bytes`), and a forward's working
memory includes the dispatch's send and receive buffers of the routed rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megapp.models.gpt import GPTConfig, placement_layer_ranges
from megapp.pipeline_parallel.asynchronous import stash_profile
from megapp.pipeline_parallel.catalog import asynchronous_run
from megapp.pipeline_parallel.schedules import Action, Op
from megapp.planning.activations import (
    full_recompute_layer_bytes,
    layer_activation_bytes,
    moe_activation_bytes,
    moe_routed_rows,
    rotary_bytes,
)
from megapp.planning.attention_working import attention_working_bytes
from megapp.planning.layer_working import layer_backward_bytes
from megapp.planning.message_buffers import pipeline_messages
from megapp.planning.model_state import (
    ModelState,
    chunk_expert_parameters,
    chunk_parameters,
    model_state,
    moe_layer_count,
    optimizer_bytes_per_parameter,
)
from megapp.planning.weight_grad_store import weight_grad_store_bytes, weight_grad_working_bytes
from megapp.planning.zero_buffers import GRAD_BYTES, chunk_zero_buffers, late_parameters

LOSS_BYTES_PER_TOKEN = 28
"""The loss's per-token tensors on the last stage: the labels' int64 copy, the row maxima,
log-normalizers, per-token losses and their transposes (fp32)."""


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes of one pipeline rank at its peak."""

    pp_rank: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # held for backward at the peak
    working: float  # the running action's temporaries at the peak
    in_flight: float  # microbatch-chunks held at the peak
    stashed: float = 0.0  # frozen copies of the weights (PipeDream, 2BW)

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer + self.stashed

    @property
    def total(self) -> float:
        return self.state + self.activations + self.working


def hidden_state_bytes(config: GPTConfig, seq_length: int, mbs: int) -> int:
    """Bytes of one ``[s, b, h]`` hidden state on a tensor-parallel rank (``s/tp`` rows of it
    under sequence parallelism): a layer's output, its gradient, a pipeline message."""
    tokens = seq_length * mbs
    if config.sequence_parallel:
        tokens //= config.tensor_model_parallel_size
    return tokens * config.hidden_size * config.params_dtype.itemsize


def _vocab_shard(config: GPTConfig) -> int:
    return config.padded_vocab_size // config.tensor_model_parallel_size


def chunk_activation_bytes(
    config: GPTConfig,
    num_layers: int,
    first: bool,
    last: bool,
    seq_length: int,
    mbs: int,
) -> int:
    """Bytes one microbatch's forward through a chunk of ``num_layers`` layers leaves held
    until its backward, on one tensor-parallel rank. The chunk's input is the first
    layer's norm input (counted with the layers). Its sent output is not: NCCL reports a
    send done at once, and what gloo keeps until the plan proves a send delivered is
    :func:`~megapp.planning.message_buffers.pipeline_messages`'."""
    s, b, h, w = seq_length, mbs, config.hidden_size, config.params_dtype.itemsize
    if config.recompute_granularity == "full":
        held = num_layers * full_recompute_layer_bytes(config, s, b)
    else:
        held = num_layers * layer_activation_bytes(config, s, b)
        held += moe_layer_count(config, num_layers) * moe_activation_bytes(config, s, b)
    held += rotary_bytes(config, s) if num_layers else 0
    if first:
        held += 8 * s * b  # the token ids the embedding's backward reads
        if config.position_embedding_type == "learned_absolute":
            held += 8 * s  # the position ids
    if last:
        held += hidden_state_bytes(config, s, b)  # the final norm's input
        held += s * b * h * w  # the output layer's input, gathered under sequence parallelism
        held += s * b * _vocab_shard(config) * w  # the logits the loss keeps
        held += LOSS_BYTES_PER_TOKEN * s * b
    return held


def chunk_working_bytes(
    config: GPTConfig,
    num_layers: int,
    last: bool,
    op: Op,
    seq_length: int,
    mbs: int,
    fused_attention: bool = False,
    first: bool = False,
) -> int:
    """Working bytes of ``op`` on a chunk above what the rank holds before it (``F``: the
    temporaries of the widest layer op and the output until sent; ``B``/``I``/``W``: the
    incoming gradient and one layer's backward, or the output layer's logit gradients).
    ``fused_attention``: context-parallel attention's blocks run in the fused kernel (on a
    CPU: :func:`~megapp.context_parallel.blocks.fused_kernel`); ``first``: the chunk is
    also the first virtual stage (it holds the word embedding)."""
    s, b, h, w = seq_length, mbs, config.hidden_size, config.params_dtype.itemsize
    tp, hidden = config.tensor_model_parallel_size, hidden_state_bytes(config, s, b)
    fc1 = config.ffn_hidden_size * (2 if config.activation == "swiglu" else 1) // tp
    if op is Op.INPUT_GRAD:
        layer = _input_half_layers(config, num_layers, s, mbs, fused_attention, last)
    else:
        layer = _widest_layer_backward(config, num_layers, s, mbs, fused_attention)
    if op is Op.FORWARD:
        attention = attention_working_bytes(config, s, b, False, fused_attention)
        work = max(s * b * fc1 * w, attention) if num_layers else 0
        if config.num_moe_experts is not None and num_layers:  # dispatch's send and receive
            rows = moe_routed_rows(config, s, b)
            work = max(work, 2 * rows * h * w)
            if config.add_bias_linear:  # the experts' first bias repeated to their rows,
                moe = config.moe_config()  # before the pair-order rows and the output exist
                made_later = rows * h + rows // moe.moe_router_topk * h
                work = max(work, (rows * moe.fc1_width - made_later) * w)
        if last:
            work = max(work, s * b * _vocab_shard(config) * w // 4)
        return work + hidden  # the output until its send completes
    if op is Op.WEIGHT_GRAD:
        return weight_grad_working_bytes(config, num_layers, last, s, b)
    output_layer = h * _vocab_shard(config) * w if last else 0  # its weight gradient
    if last:
        # the loss's backward makes the logits' gradient; the output layer's then makes its
        # input's and weight's, once the loss has freed the logits and statistics it kept
        logits = s * b * _vocab_shard(config) * w
        head = s * b * h * w + (0 if op is Op.INPUT_GRAD else output_layer)
        head = max(logits, head - LOSS_BYTES_PER_TOKEN * s * b)
        # then the last layer's backward, the head's activations and logit gradients freed;
        # a chunk that also embeds the tokens keeps the output layer's weight gradient until
        # the embedding's, for the weight they share, meets it at the end of the backward
        freed = chunk_activation_bytes(config, 0, False, True, s, mbs)
        if op is Op.INPUT_GRAD:  # the output layer's input and the logits' gradient kept
            last_layer = layer - freed + s * b * (h + _vocab_shard(config)) * w
        else:
            tied = first and op is Op.BACKWARD and config.share_embeddings_and_output_weights
            last_layer = layer - freed + hidden + (output_layer if tied else 0)
        return max(head, last_layer) if num_layers else head
    return hidden + layer  # the gradient received, and one layer's backward


def _input_half_layers(
    config: GPTConfig, num_layers: int, s: int, mbs: int, fused_attention: bool, last: bool
) -> int:
    """The most a chunk's layers work with in the input half of a split backward (``I``)
    above what the chunk held: each layer it has been through leaves what ``W`` reads less
    what the layer held (:func:`weight_grad_store_bytes` against its activations), so the
    peak is one layer's moments after all the others' (or the first layer's, where a layer
    frees more than it leaves). A layer's output gradient is a tensor of this backward but
    for the chunk's last layer's, received (on the last stage: made by the head's
    backward)."""
    if not num_layers:
        return _widest_layer_backward(config, num_layers, s, mbs, fused_attention)
    held = chunk_activation_bytes(config, num_layers, False, False, s, mbs)
    held -= rotary_bytes(config, s)
    left = (weight_grad_store_bytes(config, num_layers, False, s, mbs) - held) // num_layers
    given = _widest_layer_backward(config, num_layers, s, mbs, fused_attention, incoming=True)
    if last:
        return (num_layers - 1) * max(left, 0) + given
    first = _widest_layer_backward(config, num_layers, s, mbs, fused_attention, incoming=False)
    return max(first, (num_layers - 1) * left + given) if num_layers > 1 else first


def _widest_layer_backward(
    config: GPTConfig,
    num_layers: int,
    s: int,
    mbs: int,
    fused_attention: bool,
    incoming: bool | None = None,
) -> int:
    """The most one of a chunk's layers works with in its backward: a dense layer's or a
    mixture-of-experts layer's, whichever the chunk has; with full recompute the layer
    first rebuilds what it keeps, and the rebuilt output lives through its backward.
    ``incoming``: the input half of a split backward, the layer's output gradient made by
    this backward (True) or received (False); None: a whole backward."""
    output = hidden_state_bytes(config, s, mbs)
    moe_layers = moe_layer_count(config, num_layers)
    kinds = [True] if moe_layers else []
    if moe_layers < num_layers or not num_layers:  # a chunk of no layers is priced as dense
        kinds.append(False)
    widest = 0
    for experts in kinds:
        layer = layer_backward_bytes(config, s, mbs, fused_attention, experts, incoming)
        if config.recompute_granularity == "full":  # the layer rebuilt for its backward
            layer += layer_activation_bytes(config, s, mbs) + output
            layer += moe_activation_bytes(config, s, mbs) if experts else 0
        widest = max(widest, layer)
    return widest


def runs_on_gloo(config, transport: str | None = None) -> bool:
    """Whether the run ``config`` moves its tensors with gloo on CPU (``transport``, a
    hardware profile's: ``gloo`` or ``nccl``; None: the config's backend, or where it names
    none, this machine's: gloo without CUDA)."""
    if transport is not None:
        return transport == "gloo"
    backend = config.parallel.distributed_backend
    return backend == "gloo" or (backend is None and not torch.cuda.is_available())


def optimizer_step_bytes(state: ModelState, dtype: torch.dtype) -> float:
    """What torch's multi-tensor AdamW (megapp's optimizer on CPU) allocates in its step
    beyond the state: one fp32 tensor per optimized parameter (the square roots of the
    second moments). The fused CUDA kernels allocate none."""
    return 4 * state.optimizer / optimizer_bytes_per_parameter(dtype)


def predict_memory(config, vocab_size: int, transport: str | None = None) -> list[RankMemory]:
    """Peak memory of every pipeline rank of the run ``config`` (a
    :class:`~megapp.training.config.PretrainConfig`) for a tokenizer of ``vocab_size`` ids,
    on devices whose tensors move by ``transport`` (:func:`runs_on_gloo`). A run on gloo
    keeps a sent output until the plan proves it delivered, and its optimizer step's
    temporaries (:func:`optimizer_step_bytes`) can be its peak, after the backward."""
    model = config.gpt_config(vocab_size)
    schedule = config.schedule
    cp = config.parallel.context_parallel_size
    s, b = config.model.seq_length // cp, config.training.micro_batch_size
    dp, zero = config.data_parallel_size * cp, config.parallel.zero_stage  # ZeRO's ranks
    num_stages = schedule.num_virtual_stages
    gloo = runs_on_gloo(config, transport)
    layers = [len(r) for r in placement_layer_ranges(model, schedule.placement)]
    run = None  # an asynchronous schedule over the iterations between two flushes
    if schedule.asynchronous:
        run = asynchronous_run(schedule, config.parallel.pipeline_flush_interval)
    edp = expert_data_parallel_size(
        model, config.world_size, config.parallel.pipeline_model_parallel_size
    )
    message = hidden_state_bytes(model, s, b)
    messages = pipeline_messages(schedule)
    out = []
    for rank, stages in enumerate(schedule.placement):
        state = rank_state(model, stages, layers, dp, zero, edp)
        zeros = [
            chunk_zero_buffers(
                model,
                st,
                num_stages,
                layers[st],
                dp=dp,
                edp=edp,
                zero=zero,
                gloo=gloo,
                bucket_size=config.parallel.ddp_bucket_size,
            )
            for st in stages
        ]
        sizes, stores = [], []  # per chunk: held after F, kept from I to W
        for stage in stages:
            first, last = stage == 0, stage == num_stages - 1
            sizes.append(chunk_activation_bytes(model, layers[stage], first, last, s, b))
            stores.append(weight_grad_store_bytes(model, layers[stage], last, s, b))
        held, in_flight, peak = 0.0, 0.0, (0.0, 0.0, 0.0)
        split = any(a.op is Op.INPUT_GRAD for a in schedule.actions[rank])
        reduced = [False] * len(stages)  # split: the chunk's gradient buckets exist (ZeRO-2/3)
        forwarded = [0] * len(stages)  # its microbatches between forward and backward
        deferred = [0] * len(stages)  # and between I and W
        reducing = kept = 0.0  # those buckets' bytes; the gathered weights kept meanwhile
        working: dict[tuple[int, Op], float] = {}
        for action in schedule.actions[rank]:
            if action.op is Op.UPDATE:
                continue
            chunk, op = action.chunk, action.op
            stage = stages[chunk]
            size, store = sizes[chunk], stores[chunk]
            last = stage == num_stages - 1
            if (stage, op) not in working:  # the same for every microbatch
                working[(stage, op)] = chunk_working_bytes(
                    model, layers[stage], last, op, s, b, gloo, first=stage == 0
                )
            z = zeros[chunk]
            others = kept - (z.gathered_kept if forwarded[chunk] else 0.0)  # not this chunk's
            others -= z.gathered_split if deferred[chunk] else 0.0
            buffers = reducing + others
            if op is Op.FORWARD:
                buffers += z.gathered_forward
            elif op is Op.BACKWARD:
                buffers += z.gathered_backward
            else:  # I and W: the chunk's weights stay gathered from I to W
                buffers += z.gathered_split
            if op is Op.FORWARD:
                held, in_flight = held + size, in_flight + 1
                kept += z.gathered_kept if not forwarded[chunk] else 0.0
                forwarded[chunk] += 1
            alive = messages[rank][action]
            transport = ((alive.kept if gloo else 0) + alive.waiting) * message
            if op is Op.BACKWARD and not split:  # its buckets fill, reduce and settle in it
                moments = [others + z.during + working[(stage, op)]]
                # a reduction waited for between two buckets (a layer's input gradient and
                # the next one's first alive) or at the end, its activations freed
                settle = 2 * message if z.settles_inside else -size
                moments.append(others + z.settled + settle)
            else:
                moments = [buffers + working[(stage, op)]]
            if split and reduced[chunk] and z.waited and op in (Op.BACKWARD, Op.WEIGHT_GRAD):
                # its end waits for the reduction it started, what it kept freed
                freed = store if op is Op.WEIGHT_GRAD else size
                moments.append(buffers + z.slices + z.waited - freed)
            work = max(moments)
            if held + transport + work > peak[0] + peak[1]:
                peak = (held + transport, work, in_flight)
            if op is Op.INPUT_GRAD:  # W keeps its matmuls' inputs and gradients
                held += store - size
            elif op is Op.WEIGHT_GRAD:
                held, in_flight = held - store, in_flight - 1
            elif op is Op.BACKWARD:
                held, in_flight = held - size, in_flight - 1
            if op in (Op.INPUT_GRAD, Op.BACKWARD):
                forwarded[chunk] -= 1
                kept -= z.gathered_kept if not forwarded[chunk] else 0.0
            if op is Op.INPUT_GRAD:
                kept += z.gathered_split if not deferred[chunk] else 0.0
                deferred[chunk] += 1
            elif op is Op.WEIGHT_GRAD:
                deferred[chunk] -= 1
                kept -= z.gathered_split if not deferred[chunk] else 0.0
            if split and op in (Op.WEIGHT_GRAD, Op.BACKWARD) and not reduced[chunk]:
                reduced[chunk] = True
                reducing += z.reducing
        step = optimizer_step_bytes(state, model.params_dtype) if gloo else 0.0
        if step > peak[0] + peak[1]:  # the step, after every backward freed the buffers
            peak = (0.0, step, 0.0)
        copies = stash_profile(run, rank)[1] if run is not None else 0
        out.append(
            RankMemory(
                rank,
                state.weights,
                state.grads,
                state.optimizer,
                peak[0],
                peak[1],
                peak[2],
                stashed=copies * state.weights,
            )
        )
    return out


def expert_data_parallel_size(model: GPTConfig, world_size: int, pp: int) -> int:
    """The ranks that hold copies of the same experts: world / (etp · ep · pp)."""
    ep, etp = model.expert_model_parallel_size, model.expert_tensor_parallel_size
    return world_size // (ep * etp * pp)


def rank_state(
    model: GPTConfig, stages: Sequence[int], layers: Sequence[int], dp: int, zero: int, edp: int
) -> ModelState:
    """Model state of the pipeline rank that holds virtual ``stages`` (``layers``: every
    virtual stage's layer count): ZeRO shards the experts' over the ``edp``
    expert-data-parallel ranks (:func:`expert_data_parallel_size`), the rest over the
    ``dp`` ranks that reduce the gradients (data × context parallel)."""
    num_stages = len(layers)
    params = sum(chunk_parameters(model, st, num_stages, layers[st]) for st in stages)
    experts = sum(chunk_expert_parameters(model, layers[st]) for st in stages)
    state = model_state(params - experts, model.params_dtype, dp, zero)
    if experts:
        state += model_state(experts, model.params_dtype, edp, zero)
    if zero >= 2 and dp > 1:  # the tied embedding's whole for the step, beside its slice
        late = sum(late_parameters(model, st, num_stages) for st in stages)
        state = ModelState(state.weights, state.grads + GRAD_BYTES * late, state.optimizer)
    return state


_HELD_CODES = {Op.FORWARD: 0, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 2, Op.BACKWARD: 3}


@dataclass(frozen=True)
class HeldWalk:
    """A rank's actions as :func:`predict_memory` walks them for what they hold: each
    action's code (``4·chunk`` + 0 for a forward, 1 for ``I``, 2 for ``W``, 3 for a whole
    backward), and per chunk the positions of its forwards."""

    codes: tuple[int, ...]
    forwards: tuple[tuple[int, ...], ...]

    def floor(
        self, sizes: Sequence[float], stores: Sequence[float], working: Sequence[float]
    ) -> float:
        """A floor on the rank's peak of held and working bytes when a microbatch of chunk
        ``c`` holds ``sizes[c]`` from its forward to its input gradient, ``stores[c]`` from
        there to its ``W``, and its forward works with at least ``working[c]``: what it
        holds after every action but the last (at most what the next action's moment
        holds), and just after each forward with that forward's working memory."""
        deltas: list[float] = []
        for size, store in zip(sizes, stores, strict=True):
            deltas += [size, store - size, -store, -size]  # as predict_memory adds them
        held = list(itertools.accumulate(map(deltas.__getitem__, self.codes)))
        top = max(held[:-1], default=0.0)
        for positions, work in zip(self.forwards, working, strict=True):
            if positions:
                top = max(top, max(map(held.__getitem__, positions)) + work)
        return max(top, 0.0)


def held_walk(actions: Sequence[Action], num_chunks: int) -> HeldWalk:
    """:class:`HeldWalk` of a rank that runs ``actions`` on ``num_chunks`` model chunks."""
    actions = [a for a in actions if a.op is not Op.UPDATE]
    codes = tuple(4 * a.chunk + _HELD_CODES[a.op] for a in actions)
    forwards: list[list[int]] = [[] for _ in range(num_chunks)]
    for position, action in enumerate(actions):
        if action.op is Op.FORWARD:
            forwards[action.chunk].append(position)
    return HeldWalk(codes, tuple(map(tuple, forwards)))


def peak_bytes(memories: Sequence[RankMemory]) -> float:
    """The largest rank's predicted peak."""
    return max(m.total for m in memories)
