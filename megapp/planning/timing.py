"""How long one training iteration takes, predicted from the model, the layout and the
hardware, through the same simulator the pipeline schedules run in.

Per microbatch and model chunk, on one tensor-parallel rank (``L`` layers, ``T = s·b``
tokens, forward FLOPs of one layer split into its linear part ``lin`` and its attention
core ``core`` = q·kᵀ and p·v, as :func:`~megapp.training.flops.gpt_training_flops` counts):

- ``F`` = ``L·(lin + core)`` (+ the logits GEMM on the last stage);
- ``I`` (input gradient) = ``L·(lin + 2·core)`` (+ logits): the attention core has no
  weights, so its whole backward is input gradient; ``W`` (weight gradients) = ``L·lin``
  (+ logits); a whole backward ``B = I + W``. Recompute adds its rerun forward to ``I``:
  the whole layer with full recompute, the attention core with selective.
- FLOPs over ``Hardware.gemm_flops`` (on a profile with operation rates, ``Hardware.ops``,
  each layer's operations priced by :mod:`megapp.planning.operations` instead:
  :func:`~megapp.planning.layer_costs.compute_seconds`), plus
  ``action_overhead + L·layer_overhead`` (zero unless calibrated) per action, plus the
  loss's memory-bound passes over the logits. A whole backward pays that fixed cost
  once: split into ``I`` and ``W`` it pays it twice. A full-recompute rerun pays its
  layers' ``L·layer_overhead`` again in ``I``.
- tensor-parallel collectives on the critical path: per layer two all-reduces of the
  ``[s, b, h]`` activation in forward and two in backward (with sequence parallelism an
  all-gather and a reduce-scatter for each, the same bytes), the embedding's all-reduce,
  the output layer's and the cross-entropy's; a full-recompute rerun repeats the forward's.
- context-parallel attention (``cp`` ranks, ``T = s/cp·b`` tokens each, the attention
  core's FLOPs those of its ``s/cp`` queries against the whole sequence): the keys and
  values each mechanism moves (docs/context_parallel.md) over the cp group's link,
  NVLink while ``tp·cp`` fits a node
  (:func:`~megapp.planning.layer_costs.context_parallel_seconds`);
- mixture-of-experts layers (:func:`~megapp.planning.layer_costs.moe_layer_seconds`): the
  router's and the ``k`` experts' FLOPs in place of the dense MLP's (per token as
  :func:`~megapp.training.flops.gpt_training_flops` counts them, the experts' share scaled by
  ``Hardware.moe_load_imbalance``), and per layer an all-to-all dispatch and combine in
  forward and again in backward, each of ``T·k·h`` elements per rank, of which
  ``(ep−1)/ep`` leaves it, over NVLink while the ep group's ``etp·ep`` ranks fit a node,
  else its remote shares over InfiniBand
  (:func:`~megapp.planning.hardware.all_to_all_seconds`); nothing overlaps them; and the
  layer's memory-bound passes (permutation, the all-to-alls' buffers, the weighted sum
  of the ``k`` outputs, the activation:
  :func:`~megapp.planning.layer_costs.moe_memory_seconds`) at the copy rate, forward in F
  and backward in I. The experts' gradients reduce over the expert-data-parallel ranks,
  the rest over ``dp·cp``;
- ZeRO-3 all-gathers a chunk's weights for each microbatch's forward and its layers'
  again for its backward; ZeRO-2 and -3 reduce-scatter the chunk's fp32 gradients after
  each microbatch's backward. Where the hardware overlaps communication (NCCL streams,
  prefetch) an action takes the longer of its compute and these transfers, else their sum.

Pipeline messages (``[s, b, h]``, ``/tp`` with sequence parallelism) cost a latency plus
bytes over the pipeline group's link, a wait for the receiver;
:func:`~megapp.pipeline_parallel.simulate.simulate` then gives every rank's timeline. After
its last action a rank reduces its gradients over the data- and context-parallel ranks
(``dp·cp``; ZeRO 0:
all-reduce of fp32 gradients; 1-2: reduce-scatter, then an all-gather of the updated
16-bit weights; ZeRO-2's per-microbatch reductions are in the actions already), sums the
tied embedding over the first and last stage, and steps the optimizer at the device's
memory bandwidth. Overlap assumption: the gradient reduction
runs under the rank's backward of the last microbatch, except its last bucket (all of it
after that backward with ``--no-overlap-grad-reduce``); the weights' all-gather, the
embedding sum and the optimizer step are exposed.

:func:`predict` runs any :class:`TimeModel`: :class:`Devices` is this one, devices of their
own; processes sharing a CPU's cores have theirs in :mod:`megapp.planning.shared_cores`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from megapp.models.gpt import GPTConfig
from megapp.pipeline_parallel.catalog import asynchronous_run
from megapp.pipeline_parallel.network import Rules
from megapp.pipeline_parallel.schedules import Schedule
from megapp.pipeline_parallel.simulate import CostModel, Timeline, simulate
from megapp.planning.chunk_prices import chunk_prices
from megapp.planning.hardware import Hardware, group_link
from megapp.planning.model_state import (
    chunk_expert_parameters,
    layer_parameters,
)
from megapp.planning.step_time import StepTime, step_time
from megapp.training.config import PretrainConfig

Table = list[Sequence[float]]  # [rank][chunk]; ranks whose chunks cost the same share a row


@dataclass(frozen=True)
class Shape:
    """What the cost of one action depends on besides the model: the layout's numbers."""

    seq_length: int
    micro_batch_size: int
    placement: tuple[tuple[int, ...], ...]  # virtual stage of every [rank][chunk]
    dp: int
    zero_stage: int
    bucket_size: int  # elements per data-parallel gradient bucket
    overlap_grad_reduce: bool = True  # buckets reduced under the last backward, not after


@dataclass
class ActionCosts:
    """Seconds (and FLOPs) of one microbatch's actions per ``[rank][chunk]``, the pipeline
    message time, and every rank's work after its last action."""

    placement: tuple[tuple[int, ...], ...]  # virtual stage of every [rank][chunk]
    forward: Table
    input_grad: Table
    weight_grad: Table
    whole_backward: Table  # B: I + W paying the fixed cost of one action, not two
    flops_forward: Table
    flops_input_grad: Table
    flops_weight_grad: Table
    tp_forward: Table  # seconds of tp collectives in F of one microbatch
    tp_backward: Table  # in I (and so in B)
    collectives_forward: Table  # tp collective calls in F of one microbatch
    collectives_backward: Table  # in I (and so in B), a full-recompute rerun's included
    p2p: float
    grad_reduce: list[float]  # data-parallel reduction at the end, before overlap
    tail: list[float]  # exposed after the last action: reduction, sums, optimizer, gathers
    optimizer: list[float]
    embedding_sum: list[float] | None = None  # tied embedding's sum, first and last rank
    cp_forward: Table | None = None  # exposed seconds of cp attention's transfers in F
    cp_backward: Table | None = None  # in I (and so in B), a recompute's rerun included
    cp_calls_forward: Table | None = None  # cp transfers posted in F (ring steps, collectives)
    cp_calls_backward: Table | None = None  # in I (and so in B)

    @property
    def tensor_parallel(self) -> Table:
        """Seconds of tp collectives in F + I of one microbatch."""
        pairs = zip(self.tp_forward, self.tp_backward, strict=True)
        return [[f + b for f, b in zip(rf, rb, strict=True)] for rf, rb in pairs]

    @property
    def context_parallel(self) -> Table:
        """Exposed seconds of cp attention's transfers in F + I of one microbatch."""
        if self.cp_forward is None or self.cp_backward is None:
            return [[0.0] * len(row) for row in self.forward]
        pairs = zip(self.cp_forward, self.cp_backward, strict=True)
        return [[f + b for f, b in zip(rf, rb, strict=True)] for rf, rb in pairs]

    def busy(self, rank: int, num_microbatches: int, split_backward: bool = True) -> float:
        """Seconds rank ``rank`` computes in one iteration, its backwards split into ``I``
        and ``W`` or not."""
        if split_backward:  # the sum of I then W, as of their rows joined
            backward = sum(self.weight_grad[rank], sum(self.input_grad[rank]))
        else:
            backward = sum(self.whole_backward[rank])
        return num_microbatches * (sum(self.forward[rank]) + backward)

    def lower_bounds(
        self, num_microbatches: int, step_overhead: float = 0.0
    ) -> tuple[float, float]:
        """Times no schedule beats, with whole backwards and with split ones, without
        simulating one: every rank idles until the first microbatch reaches its earliest
        stage, then computes all its actions; and the last microbatch to leave stage 0 (no
        sooner than ``m`` forwards of it) still runs forward through every later stage and
        back before stage 0's ``I`` and ``W``. Without split backwards a rank's last action
        is the backward of its lowest stage, after which that microbatch's backward still
        runs through every stage below it. Every step between stages on two ranks costs a
        pipeline message (``p2p``) on the way: its receiver starts no sooner."""
        p, m = len(self.forward), num_microbatches
        order: list[tuple[int, int]] = [(0, 0)] * sum(len(row) for row in self.placement)
        for r, row in enumerate(self.placement):
            for c, stage in enumerate(row):
                order[stage] = (r, c)
        f = [self.forward[r][c] for r, c in order]
        i = [self.input_grad[r][c] for r, c in order]
        b = [self.whole_backward[r][c] for r, c in order]
        # hop[s]: the message into stage s from stage s - 1 (none within a rank)
        hop = [0.0] + [self.p2p * (order[s][0] != order[s - 1][0]) for s in range(1, len(f))]
        # sums of the first s stages' forwards and backwards, and of the hops into stages 0..s
        f_before = list(itertools.accumulate(f, initial=0.0))
        b_before = list(itertools.accumulate(b, initial=0.0))
        hops_to = list(itertools.accumulate(hop))
        first_rank, first_chunk = order[0]
        chain = m * f[0] + sum(f[1:]) + sum(i) + self.weight_grad[first_rank][first_chunk]
        chain += 2 * sum(hop) + self.tail[first_rank]
        whole, split = [chain], [chain]
        for rank in range(p):
            lowest = min(self.placement[rank])
            # when its first input can arrive: the forwards and hops before its lowest stage
            start = f_before[lowest] + hops_to[lowest]
            done = start + self.busy(rank, m, split_backward=False)
            whole.append(done + self.tail[rank])
            if lowest > 0:
                down = b_before[lowest] + hops_to[lowest]
                whole.append(done + down + self.tail[first_rank])
            split.append(start + self.busy(rank, m) + self.tail[rank])
        return step_overhead + max(whole), step_overhead + max(split)


def action_costs(gpt: GPTConfig, shape: Shape, hardware: Hardware) -> ActionCosts:
    """Seconds of every action of one microbatch on every ``[rank][chunk]`` of
    ``shape.placement``, layers split evenly over the virtual stages as megapp builds them."""
    p, num_stages = len(shape.placement), sum(len(row) for row in shape.placement)
    tp, cp = gpt.tensor_model_parallel_size, gpt.context_parallel_size
    dp = shape.dp * cp  # the ranks that reduce the gradients and share ZeRO's shards
    dp_link = group_link(hardware, tp * dp)
    pp_link = group_link(hardware, tp * dp * p)
    tokens = shape.seq_length // cp * shape.micro_batch_size
    width = gpt.params_dtype.itemsize
    vocab = gpt.padded_vocab_size
    prices = chunk_prices(gpt, shape.seq_length, shape.micro_batch_size, hardware)
    layers = prices.stage_layers(shape.placement)
    names = ("f", "i", "w", "b", "ff", "fi", "fw", "tpf", "tpb", "cf", "cb")
    names += ("cpf", "cpb", "ccf", "ccb")
    tables: dict[str, Table] = {}
    layer_params = layer_parameters(gpt)
    chunks: dict[tuple[int, bool, bool], tuple[int, tuple[float, ...]]] = {}
    # what a chunk's costs depend on: its layers, and whether it is the first or the last
    # stage (chunks of one kind cost the same)
    kinds = [(layers[s], s == 0, s == num_stages - 1) for s in range(num_stages)]

    def chunk(kind: tuple[int, bool, bool]) -> tuple[int, tuple[float, ...]]:
        """Parameters and (F, I, W, B seconds, F, I, W FLOPs, tp seconds in F, in I, tp
        calls in F, in I, cp seconds in F, in I, cp transfers in F, in I) of one chunk."""
        count = kind[0]  # its layers
        chunk_params, (f_s, i_s, w_s, fixed, *rest) = prices.chunk(*kind)
        # ZeRO-3 gathers the chunk before its forward and the layers before backward;
        # ZeRO-2/3 reduce-scatter the chunk's fp32 gradients bucket by bucket in every
        # backward, which waits for the last bucket's (started once its gradients are in)
        gather_f = gather_b = scatter = tail = 0.0
        if shape.zero_stage == 3:
            gather_f = dp_link.all_gather(width * chunk_params, dp)
            gather_b = gather_f * count * layer_params / max(chunk_params, 1)
        if shape.zero_stage >= 2:
            scatter = dp_link.all_gather(4 * chunk_params, dp)
            tail = scatter * min(1.0, shape.bucket_size / max(chunk_params, 1))
        f_s = _with_transfer(f_s, gather_f, hardware)
        i_s = _with_transfer(i_s, gather_b, hardware)
        w_s = _with_transfer(w_s, scatter - tail, hardware) + tail
        b_s = i_s + w_s - fixed  # one action, not two
        return chunk_params, (f_s, i_s, w_s, b_s, *rest)

    sp = gpt.sequence_parallel
    p2p = pp_link.message(tokens * gpt.hidden_size * width / (tp if sp else 1))
    v_shaped = any(row[0] == 0 and row[-1] == num_stages - 1 for row in shape.placement[:1])
    tied = gpt.share_embeddings_and_output_weights and p > 1 and not v_shaped
    embedding_sum = pp_link.all_reduce(4 * vocab // tp * gpt.hidden_size, 2) if tied else 0.0
    # the copies of each expert: world / (etp · ep · pp), spanning as many ranks as dp · cp
    edp = tp * dp // (gpt.expert_tensor_parallel_size * gpt.expert_model_parallel_size)

    def rank_costs(stages: tuple[int, ...], ends: bool) -> tuple:
        """A rank's rows of the tables and its (end-of-step reduction, tail, optimizer step,
        embedding sum), from the stages of its chunks."""
        for stage in stages:
            if kinds[stage] not in chunks:
                chunks[kinds[stage]] = chunk(kinds[stage])
        held = [chunks[kinds[stage]] for stage in stages]
        rows = list(zip(*(values for _, values in held), strict=True))
        rank_params = sum(n for n, _ in held)
        experts = sum(chunk_expert_parameters(gpt, layers[stage]) for stage in stages)
        dense = rank_params - experts
        # every bucket's collective beyond one pays its ring steps
        calls = sum(max(1, math.ceil(n / shape.bucket_size)) for n, _ in held) - 1
        if shape.zero_stage == 0:
            end = dp_link.all_reduce(4 * dense, dp) + calls * dp_link.all_reduce(0.0, dp)
            end += dp_link.all_reduce(4 * experts, edp) if experts else 0.0
        elif shape.zero_stage == 1:
            end = dp_link.all_gather(4 * dense, dp) + calls * dp_link.all_gather(0.0, dp)
            end += dp_link.all_gather(4 * experts, edp) if experts else 0.0
        else:
            end = 0.0  # reduced microbatch by microbatch inside the actions
        window = sum(rows[names.index("w")]) + sum(rows[names.index("i")])  # last microbatch
        last_bucket = end * min(1.0, shape.bucket_size / max(rank_params, 1))
        overlapped = hardware.overlap_communication and shape.overlap_grad_reduce
        exposed = max(end - window, last_bucket) if overlapped else end
        gather = 0.0
        if shape.zero_stage in (1, 2):
            gather = dp_link.all_gather(width * dense, dp)
            gather += dp_link.all_gather(width * experts, edp) if experts else 0.0
        owned = dense / (dp if shape.zero_stage >= 1 else 1)
        owned += experts / (edp if shape.zero_stage >= 1 else 1)
        held_grads = rank_params if shape.zero_stage < 2 else owned  # zeroed every step
        step = (owned * _optimizer_bytes(width) + 4 * held_grads) / hardware.memory_bandwidth
        summed = embedding_sum * ends
        return rows, end, exposed + gather + step + summed, step, summed

    # ranks whose chunks are of the same kinds cost the same
    rank_keys = [
        (tuple([kinds[stage] for stage in stages]), rank in (0, p - 1))
        for rank, stages in enumerate(shape.placement)
    ]
    ranks: dict[tuple, tuple] = {}
    for key, stages in zip(rank_keys, shape.placement, strict=True):
        if key not in ranks:
            ranks[key] = rank_costs(stages, key[1])
    per_rank = [ranks[key] for key in rank_keys]
    for column, name in enumerate(names):
        tables[name] = [costs[0][column] for costs in per_rank]
    reduce, tail, optimizer, sums = ([costs[k] for costs in per_rank] for k in range(1, 5))
    return ActionCosts(
        placement=shape.placement,
        forward=tables["f"],
        input_grad=tables["i"],
        weight_grad=tables["w"],
        whole_backward=tables["b"],
        flops_forward=tables["ff"],
        flops_input_grad=tables["fi"],
        flops_weight_grad=tables["fw"],
        tp_forward=tables["tpf"],
        tp_backward=tables["tpb"],
        collectives_forward=tables["cf"],
        collectives_backward=tables["cb"],
        p2p=p2p,
        grad_reduce=reduce,
        tail=tail,
        optimizer=optimizer,
        embedding_sum=sums,
        cp_forward=tables["cpf"],
        cp_backward=tables["cpb"],
        cp_calls_forward=tables["ccf"],
        cp_calls_backward=tables["ccb"],
    )


def _with_transfer(compute: float, transfer: float, hardware: Hardware) -> float:
    if hardware.overlap_communication:
        return max(compute, transfer)
    return compute + transfer


def _optimizer_bytes(width: int) -> int:
    """Bytes AdamW moves per owned parameter: reads the fp32 gradient twice (once for the
    gradient norm), reads and writes the fp32 master (fp32 weights are their own) and both
    moments, and copies the master into the 16-bit weight (a pass of its own: reads fp32,
    writes 16-bit)."""
    return 4 + 4 + 8 + 16 + (4 + width if width < 4 else 0)


def shape_of(config: PretrainConfig) -> Shape:
    """The :class:`Shape` of a checked config."""
    return Shape(
        seq_length=config.model.seq_length,
        micro_batch_size=config.training.micro_batch_size,
        placement=tuple(tuple(row) for row in config.schedule.placement),
        dp=config.data_parallel_size,
        zero_stage=config.parallel.zero_stage,
        bucket_size=config.parallel.ddp_bucket_size,
        overlap_grad_reduce=config.parallel.overlap_grad_reduce,
    )


def cost_model(costs: ActionCosts, hardware: Hardware) -> CostModel:
    """The simulator's cost model of ``costs`` on ``hardware``'s transport (an optimizer
    step ``U`` of an asynchronous schedule costs the rank's tail)."""
    return CostModel(
        forward=costs.forward,
        backward=costs.whole_backward,
        input_grad=costs.input_grad,
        weight_grad=costs.weight_grad,
        p2p_latency=costs.p2p,
        rules=Rules(hardware.transport),
        update=costs.tail,
    )


def simulated_run(config: PretrainConfig) -> tuple[Schedule, int]:
    """The schedule the time model simulates and the iterations it spans: the config's, or
    for PipeDream and 2BW a run of ``--pipeline-flush-interval`` iterations, whose optimizer
    steps (reduction, step, gathers: the tail) are among its actions."""
    if not config.schedule.asynchronous:
        return config.schedule, 1
    iterations = config.parallel.pipeline_flush_interval
    return asynchronous_run(config.schedule, iterations), iterations


class TimeModel(Protocol):
    """What :func:`predict` and the planner's search run: a ``hardware`` profile, the
    action costs of a model and layout on it, and the schedule's run with those costs."""

    @property
    def hardware(self) -> Hardware: ...

    def with_gpus_per_node(self, gpus_per_node: int) -> TimeModel: ...

    def action_costs(self, gpt: GPTConfig, shape: Shape) -> ActionCosts: ...

    def run(
        self, schedule: Schedule, costs: ActionCosts, world_size: int
    ) -> tuple[ActionCosts, Timeline]:
        """The costs as the run pays them and the timeline of ``schedule`` on
        ``world_size`` processes; raises
        :class:`~megapp.pipeline_parallel.messages.ScheduleError` on a deadlock."""
        ...


@dataclass(frozen=True)
class Devices:
    """Devices of their own (GPUs): every rank computes on its own device and a pipeline
    message is a wait for its receiver (:func:`action_costs`, then
    :func:`~megapp.pipeline_parallel.simulate.simulate`)."""

    hardware: Hardware

    def with_gpus_per_node(self, gpus_per_node: int) -> Devices:
        return Devices(self.hardware.with_gpus_per_node(gpus_per_node))

    def action_costs(self, gpt: GPTConfig, shape: Shape) -> ActionCosts:
        return action_costs(gpt, shape, self.hardware)

    def run(
        self, schedule: Schedule, costs: ActionCosts, world_size: int
    ) -> tuple[ActionCosts, Timeline]:
        return costs, simulate(schedule, cost_model(costs, self.hardware))


@dataclass(frozen=True)
class SimulatedStep:
    """One prediction's parts: the model, the action costs as priced and as run, the
    simulated schedule and the step assembled from its timeline."""

    gpt: GPTConfig
    planned: ActionCosts
    costs: ActionCosts
    schedule: Schedule
    step: StepTime


def simulate_step(config: PretrainConfig, vocab_size: int, model: TimeModel) -> SimulatedStep:
    """Price ``config``'s actions under the time ``model``, simulate its schedule and
    assemble the step (:func:`predict`, keeping the parts)."""
    gpt = config.gpt_config(vocab_size)
    planned = model.action_costs(gpt, shape_of(config))
    schedule, _ = simulated_run(config)
    costs, timeline = model.run(schedule, planned, config.world_size)
    step = step_time(config, gpt, costs, timeline, model.hardware)
    return SimulatedStep(gpt, planned, costs, schedule, step)


def predict(config: PretrainConfig, vocab_size: int, model: TimeModel) -> StepTime:
    """The predicted iteration of ``config`` for a tokenizer of ``vocab_size`` ids under the
    time ``model``. Raises :class:`~megapp.pipeline_parallel.messages.ScheduleError` when
    the schedule cannot complete on the hardware's transport."""
    return simulate_step(config, vocab_size, model).step


def predict_step_time(config: PretrainConfig, vocab_size: int, hardware: Hardware) -> StepTime:
    """The predicted iteration of ``config`` for a tokenizer of ``vocab_size`` ids on the
    devices ``hardware`` describes. Raises
    :class:`~megapp.pipeline_parallel.messages.ScheduleError` when the schedule cannot
    complete on the hardware's transport (NCCL: sends complete in batches)."""
    return predict(config, vocab_size, Devices(hardware))
