"""What one layer costs for one microbatch on one rank: its forward FLOPs, its compute
seconds (FLOPs at the profile's rate, or priced operation by operation by
:mod:`megapp.planning.operations`), and its tensor-, context- and expert-parallel
communication. :mod:`megapp.planning.timing` adds them up into every action of a schedule;
its docstring states the model.
"""

from __future__ import annotations

import math

from megapp.models.gpt import GPTConfig
from megapp.planning.activations import moe_routed_rows
from megapp.planning.hardware import (
    Hardware,
    all_to_all_seconds,
    group_link,
    members_per_node,
)
from megapp.planning.model_state import moe_layer_count
from megapp.planning.operations import (
    LayerSeconds,
    layer_parts_with_experts,
    layer_seconds,
    logits_seconds,
)
from megapp.planning.tp_overlap import overlapped_seconds
from megapp.training.flops import layer_flops as layer_flops_per_token
from megapp.training.flops import moe_mlp_flops


def layer_flops(gpt: GPTConfig, seq_length: int, micro_batch_size: int) -> tuple[float, float]:
    """Forward FLOPs of one layer for one microbatch on one tensor- and context-parallel
    rank: ``(linear, attention_core)`` of :func:`~megapp.training.flops.layer_flops` for its
    ``s/cp`` tokens, whose queries see the whole sequence of ``seq_length``."""
    linear, core = layer_flops_per_token(gpt, seq_length)
    tokens = seq_length // gpt.context_parallel_size * micro_batch_size
    tp = gpt.tensor_model_parallel_size
    return tokens * linear / tp, tokens * core / tp


def all_to_all_bytes(gpt: GPTConfig, seq_length: int, micro_batch_size: int) -> float:
    """Bytes one rank's dispatch (or combine) all-to-all carries in one mixture-of-experts
    layer: its ``T`` routed tokens (``s/cp·b``, ``/tp`` under sequence parallelism) ``k``
    times, ``T·k·h`` elements; ``(ep−1)/ep`` of it leaves the rank."""
    rows = moe_routed_rows(gpt, seq_length // gpt.context_parallel_size, micro_batch_size)
    return rows * gpt.hidden_size * gpt.params_dtype.itemsize


def moe_layer_seconds(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware
) -> tuple[float, float]:
    """What a mixture-of-experts layer adds to a dense one for one microbatch on one rank:
    forward FLOPs (router and ``k`` experts less the dense MLP, the experts' scaled by the
    load imbalance; negative where the experts are narrower) and the seconds of its dispatch
    and combine all-to-alls in one pass (forward; backward moves the same)."""
    tokens = seq_length // gpt.context_parallel_size * micro_batch_size
    tp, ep = gpt.tensor_model_parallel_size, gpt.expert_model_parallel_size
    experts = moe_mlp_flops(gpt) - 2 * gpt.hidden_size * gpt.num_moe_experts
    router = 2 * gpt.hidden_size * gpt.num_moe_experts
    per_token = router + experts * hardware.moe_load_imbalance
    dense = (6 if gpt.activation == "swiglu" else 4) * gpt.hidden_size * gpt.ffn_hidden_size
    flops = tokens * (per_token - dense) / tp
    span = gpt.expert_tensor_parallel_size * ep
    volume = all_to_all_bytes(gpt, seq_length, micro_batch_size) * hardware.moe_load_imbalance
    if gpt.moe_token_dispatcher_type == "hierarchical":
        return flops, 2 * hierarchical_dispatch_seconds(gpt, volume, hardware)
    return flops, 2 * all_to_all_seconds(hardware, volume, ep, span)


def missed(experts: int, held: int, k: int) -> float:
    """The chance that none of ``k`` distinct experts chosen uniformly from ``experts`` is
    one of ``held`` given ones: ``C(E − H, k) / C(E, k)``."""
    return math.prod((experts - held - i) / (experts - i) for i in range(k))


def hierarchical_dispatch_seconds(gpt: GPTConfig, routed_bytes: float, hardware: Hardware) -> float:
    """Seconds of one dispatch (or combine) of the hierarchical dispatcher
    (:mod:`megapp.moe.hierarchical`) for a rank whose ``R = T·k`` routed rows are
    ``routed_bytes``, the experts chosen uniformly: the ``m`` members of the expert-parallel
    group on a node (``n`` nodes) exchange, first over InfiniBand, a token once per other
    node holding one of its experts (``(n − 1)(1 − P_node)`` rows a token, ``P_node`` the
    chance a node holds none of its ``k``), then over NVLink each arrived row once per
    other member holding one of its experts (``n·(m − 1)(1 − P_rank)`` rows a token), one
    step after the other."""
    ep, k, experts = gpt.expert_model_parallel_size, gpt.moe_router_topk, gpt.num_moe_experts
    span = gpt.expert_tensor_parallel_size * ep
    m = members_per_node(hardware, ep, span)
    nodes, row = ep // m, routed_bytes / k  # bytes of one token
    across = row * (nodes - 1) * (1 - missed(experts, experts // nodes, k))
    within = row * nodes * (m - 1) * (1 - missed(experts, experts // ep, k))
    seconds = 0.0
    if nodes > 1:
        seconds += (nodes - 1) * hardware.inter_node_latency
        seconds += across / hardware.inter_node_bandwidth
    if m > 1:
        seconds += (m - 1) * hardware.intra_node_latency + within / hardware.intra_node_bandwidth
    return seconds


def moe_memory_bytes(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int
) -> tuple[float, float, int, int]:
    """Bytes the memory-bound passes of one mixture-of-experts layer move on one rank for
    one microbatch (its forward, its backward) and their kernels, as megapp's all-to-all
    dispatcher runs them (:mod:`megapp.moe.dispatch`): each pass's operands, read and
    written, a fresh buffer only written.

    With ``T`` routed tokens (as :func:`all_to_all_bytes`), ``R = T·k`` rows, ``w`` bytes
    per element, the weights combined in float32 (``c = 4``; a cast moves ``u = w + c``
    per element where ``w < c``), ``f`` the experts' width per expert-tensor-parallel rank:

    - forward, per element of ``h``: the router's input cast ``T·u``; the permutation
      ``(T + R)·w``; the un-permutation's zeroed buffer and copy ``4R·w``; the weighted sum
      of the ``k`` outputs, ``R·(w + c) + (R + T)·c + T·u``; and the activation over
      ``R·f`` (SwiGLU ``3R·f·w``, GeLU ``2R·f·w``);
    - backward: the weighted sum's gradients ``5R·c + R·w + R·u + T·u`` and the router
      cast's ``T·u``, the un-permutation's ``2R·w``, the permutation's ``(3T + R)·w``, the
      two paths into the input summed ``3T·w``; the activation rebuilt and its gradient,
      ``8R·f·w`` (GeLU ``5R·f·w``);
    - with ``ep > 1`` the received rows reordered by expert and placed back for the
      return trip, ``6R·h·w`` each way (balanced: ``R`` rows arrive; the sorted pairs go out
      as they are; the transfers themselves are :func:`moe_layer_seconds`'s).

    ``tests/test_planning_experts.py`` counts a layer's passes and checks these. Expert
    tensor parallelism's gathers (etp > 1) and the router's ``[T, E]`` scores are left
    out, as are the experts' biases (a model with ``--disable-bias-linear`` has none)."""
    k, h = gpt.moe_router_topk, gpt.hidden_size
    r = moe_routed_rows(gpt, seq_length // gpt.context_parallel_size, micro_batch_size)
    t, w, c = r // k, gpt.params_dtype.itemsize, 4
    u = w + c if w < c else 0
    f = gpt.moe_ffn_hidden_size // gpt.expert_tensor_parallel_size
    gated = gpt.activation == "swiglu"
    forward = h * (t * u + (t + r) * w + 4 * r * w + r * (w + c) + (r + t) * c + t * u)
    forward += (3 if gated else 2) * r * f * w
    backward = h * (5 * r * c + r * w + r * u + 2 * t * u + 2 * r * w + (3 * t + r) * w)
    backward += h * 3 * t * w + (8 if gated else 5) * r * f * w
    kernels_f, kernels_b = 8, 12
    if gpt.expert_model_parallel_size > 1:
        forward += 6 * r * h * w
        backward += 6 * r * h * w
        kernels_f, kernels_b = kernels_f + 3, kernels_b + 3
    return forward, backward, kernels_f, kernels_b


def moe_memory_seconds(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware
) -> tuple[float, float]:
    """Forward and backward seconds of :func:`moe_memory_bytes`: at the copy rate and
    per-kernel cost of the profile's operation rates, or its memory bandwidth."""
    forward, backward, kernels_f, kernels_b = moe_memory_bytes(gpt, seq_length, micro_batch_size)
    ops = hardware.ops
    if ops is None:
        return forward / hardware.memory_bandwidth, backward / hardware.memory_bandwidth
    rate_f, rate_b = ops.kernel("copy", 0, forward, backward)
    extra = ops.kernel_overhead
    return rate_f + (kernels_f - 1) * extra, rate_b + (kernels_b - 1) * extra


def moe_layer_parts(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware
) -> dict[str, tuple[float, float, float]]:
    """One mixture-of-experts layer's device seconds on one rank by kind of work, each as
    (forward, input gradient, weight gradient), as :func:`moe_compute_seconds` and
    :func:`moe_memory_seconds` price them on a profile with operation rates: the attention
    half's and the experts'
    (:func:`~megapp.planning.operations.layer_parts_with_experts`), the layer's
    memory-bound passes added to ``memory`` (the backward's in the input gradient)."""
    if hardware.ops is None:
        raise ValueError(f"hardware {hardware.name!r} has no operation rates")
    out = layer_parts_with_experts(
        gpt, seq_length, micro_batch_size, hardware.ops, hardware.moe_load_imbalance
    )
    forward, backward = moe_memory_seconds(gpt, seq_length, micro_batch_size, hardware)
    f, i, w = out["memory"]
    out["memory"] = (f + forward, i + backward, w)
    return out


def context_parallel_seconds(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, hardware: Hardware, core: float
) -> tuple[float, float, int, int]:
    """Exposed seconds of one layer's context-parallel transfers in its forward and its
    backward on one rank, and the transfers each posts (ring steps or collective calls);
    ``core`` is the seconds of the layer's attention core forward on the rank (what the ring
    steps overlap, :func:`compute_seconds`).

    Per rank, with ``n = s/cp`` tokens, ``w`` bytes per element and ``h_kv`` the key/value
    width of the rank's tensor-parallel heads (docs/context_parallel.md), over the cp
    group's link (:func:`~megapp.planning.hardware.group_link` of ``tp·cp`` ranks):

    - ``p2p``: ``cp − 1`` ring steps forward, each sending ``2·n·b·h_kv·w`` while the step's
      attention (``1/cp`` of the core's FLOPs) runs: exposed ``max(0, transfer − compute)``
      per step. Backward: the keys and values again (``cp − 1`` steps) and an accumulator
      of their gradients (``cp`` hops, in float32 for 16-bit models); step ``t`` overlaps
      the next keys and the accumulator of step ``t − 1`` with its ``2/cp`` of the core's
      FLOPs, the last hop overlaps nothing.
    - ``all_gather``: an all-gather of the whole sequence's ``2·s·b·h_kv·w`` forward, a
      reduce-scatter of its gradient backward; neither overlaps.
    - ``a2a``: three all-to-alls forward (``n·b·h``, ``2·n·b·h_kv·f``, ``n·b·h`` for the
      rank's heads, ``f`` the key/value repeats) and three backward; none overlaps; a cp
      group across nodes pays its remote shares over InfiniBand
      (:func:`~megapp.planning.hardware.all_to_all_seconds`).

    Without ``hardware.overlap_communication`` nothing overlaps."""
    cp = gpt.context_parallel_size
    if cp == 1:
        return 0.0, 0.0, 0, 0
    from megapp.context_parallel.a2a import kv_repeats

    tp, d = gpt.tensor_model_parallel_size, gpt.kv_channels
    heads, groups = gpt.num_attention_heads // tp, gpt.num_query_groups // tp
    link = group_link(hardware, tp * cp)
    w = gpt.params_dtype.itemsize
    n, b = seq_length // cp, micro_batch_size
    kind = gpt.cp_comm_type
    if kind == "all_gather":
        gathered = 2 * seq_length * b * groups * d * w
        return link.all_gather(gathered, cp), link.all_gather(gathered, cp), 1, 1
    if kind == "a2a":
        q_bytes = n * b * heads * d * w
        kv_bytes = 2 * n * b * groups * kv_repeats(groups, cp) * d * w
        span = tp * cp
        seconds = 2 * all_to_all_seconds(hardware, q_bytes, cp, span)
        seconds += all_to_all_seconds(hardware, kv_bytes, cp, span)
        return seconds, seconds, 3, 3
    step = core / cp  # every ring step attends over the same number of pairs
    keys = link.message(2 * n * b * groups * d * w)
    accumulator = link.message(2 * n * b * groups * d * max(w, 4))

    def exposed(transfer: float, compute: float) -> float:
        if not hardware.overlap_communication:
            return transfer
        return max(0.0, transfer - compute)

    forward = (cp - 1) * exposed(keys, step)
    backward = sum(
        exposed(keys * (t < cp - 1) + accumulator * (t > 0), 2 * step) for t in range(cp)
    )
    return forward, backward + accumulator, cp - 1, 2 * cp - 1


def compute_seconds(
    gpt: GPTConfig, seq_length: int, micro_batch_size: int, vocab: int, hardware: Hardware
) -> tuple[LayerSeconds, LayerSeconds]:
    """One dense layer's and the output layer's compute for one microbatch on one rank:
    priced operation by operation where ``hardware.ops`` has rates
    (:mod:`megapp.planning.operations`), else their FLOPs at ``hardware.gemm_flops``."""
    tokens = seq_length // gpt.context_parallel_size * micro_batch_size
    if hardware.ops is not None:
        return (
            layer_seconds(gpt, seq_length, micro_batch_size, hardware.ops),
            logits_seconds(gpt, tokens, vocab, hardware.ops),
        )
    lin, core = (x / hardware.gemm_flops for x in layer_flops(gpt, seq_length, micro_batch_size))
    logits = 2.0 * tokens * gpt.hidden_size * vocab / gpt.tensor_model_parallel_size
    logits /= hardware.gemm_flops
    layer = LayerSeconds(lin + core, lin + 2 * core, lin, core_forward=core)
    return layer, LayerSeconds(logits, logits, logits)


def moe_compute_seconds(
    gpt: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    hardware: Hardware,
    dense: LayerSeconds,
) -> LayerSeconds:
    """One mixture-of-experts layer's compute for one microbatch on one rank, as
    :func:`compute_seconds` prices a dense one (``dense``, its first result): operation by
    operation, the experts as grouped matmuls
    (:func:`~megapp.planning.operations.expert_parts`, their rows scaled by the load
    imbalance), else ``dense`` with :func:`moe_layer_seconds`' FLOPs added at
    ``hardware.gemm_flops``. Their memory-bound passes are :func:`moe_memory_seconds`'."""
    if hardware.ops is not None:
        return layer_seconds(
            gpt, seq_length, micro_batch_size, hardware.ops,
            experts=True, imbalance=hardware.moe_load_imbalance,
        )  # fmt: skip
    extra = moe_layer_seconds(gpt, seq_length, micro_batch_size, hardware)[0] / hardware.gemm_flops
    return LayerSeconds(
        dense.forward + extra,
        dense.input_grad + extra,
        dense.weight_grad + extra,
        core_forward=dense.core_forward,
    )


def tensor_parallel_seconds(
    gpt: GPTConfig,
    seq_length: int,
    micro_batch_size: int,
    layers: int,
    first: bool,
    last: bool,
    hardware: Hardware,
) -> tuple[float, float, int, int]:
    """Seconds of tensor-parallel collectives in the forward and the backward of one
    microbatch through a chunk of ``layers`` layers (``first``, ``last``: the chunk holds
    the embedding, the output layer and the loss), and their calls (a recomputed forward's
    run again in the backward)."""
    tp = gpt.tensor_model_parallel_size
    if tp == 1:
        return 0.0, 0.0, 0, 0
    link = group_link(hardware, tp)
    tokens = seq_length // gpt.context_parallel_size * micro_batch_size
    act = tokens * gpt.hidden_size * gpt.params_dtype.itemsize
    if gpt.sequence_parallel:  # an all-gather and a reduce-scatter move one all-reduce's bytes
        pair = 2 * link.all_gather(act, tp)
        fwd, bwd = 2 * pair * layers, 2 * pair * layers
        if gpt.tp_comm_overlap and hardware.overlap_communication:  # else nothing hides
            moe = moe_layer_count(gpt, layers)
            dense = overlapped_seconds(gpt, seq_length, micro_batch_size, hardware)
            experts = (
                overlapped_seconds(gpt, seq_length, micro_batch_size, hardware, dense_mlp=False)
                if moe
                else dense  # no such layer: weighted by 0
            )
            fwd, bwd = ((layers - moe) * a + moe * b for a, b in zip(dense, experts, strict=True))
        fwd += pair / 2 * (first + last)  # embedding's reduce-scatter, output's all-gather
        bwd += pair / 2 * (first + last)
        calls_f = calls_b = 4 * layers + first + last
    else:
        fwd, bwd = 2 * layers * link.all_reduce(act, tp), 2 * layers * link.all_reduce(act, tp)
        fwd += link.all_reduce(act, tp) * first  # the vocab-parallel embedding's sum
        bwd += link.all_reduce(act, tp) * last  # the output layer's input gradient
        calls_f, calls_b = 2 * layers + first, 2 * layers + last
    if last:  # cross-entropy: max, sum of exponentials, target logit, each [s, b] fp32
        fwd += 3 * link.all_reduce(4 * tokens, tp)
        calls_f += 3
    if gpt.recompute_granularity == "full":
        bwd += fwd
        calls_b += calls_f
    return fwd, bwd, calls_f, calls_b
