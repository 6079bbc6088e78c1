"""The planner's mixture-of-experts arithmetic: parameters per rank against a built model,
the all-to-all volumes, the searched expert layouts and the sweep's ep axis."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megapp.models import GPTConfig, build_gpt_chunks
from megapp.planning.layout import Layout, pretrain_config
from megapp.planning.model_state import expert_parameters, layer_parameters, rank_parameters
from megapp.tensor_parallel.random import model_parallel_manual_seed
from megapp.testing import distributed

MOE = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=257,
    max_position_embeddings=32,
    ffn_hidden_size=96,
    activation="swiglu",
    num_moe_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_layer_freq=2,
    params_dtype=torch.float32,
    make_vocab_size_divisible_by=128,
)


def test_rank_parameters_count_the_built_experts():
    config = GPTConfig(**MOE)
    torch.manual_seed(0)
    model_parallel_manual_seed(0)
    (chunk,) = build_gpt_chunks(config)
    built = sum(p.numel() for p in chunk.parameters())
    assert rank_parameters(config, [0], 1) == built
    expert = 64 * 96 + 96 + 48 * 64 + 64  # fc1 (h × 2·48, SwiGLU) and fc2 (48 × h), biases
    assert expert_parameters(config) == 8 * expert
    dense = 64 * 192 + 192 + 96 * 64 + 64
    assert layer_parameters(config, True) - layer_parameters(config, False) == (
        8 * 64 + 8 * expert - dense  # the router, 8 experts, no dense MLP
    )
    # ep 2 holds half of every MoE layer's experts: two MoE layers of four, 4 experts less each
    split = dataclasses.replace(config, expert_model_parallel_size=2)
    assert rank_parameters(split, [0], 1) == built - 2 * 4 * expert


MIXTRAL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
MIXTRAL += ["--seq-length", "32", "--max-position-embeddings", "32"]
MIXTRAL += ["--num-experts", "8", "--moe-router-topk", "2"]


def test_a_layout_carries_ep_to_its_flags_and_the_config():
    layout = Layout(tp=2, dp=4, ep=4, sequence_parallel=True)
    assert layout.name.startswith("tp2.ep4.pp1.dp4")
    assert Layout(tp=2, dp=4).name == "tp2.pp1.dp4.v1.mb1.default.norecompute.z0"
    assert "--expert-model-parallel-size" in layout.flags(4)
    assert "--expert-tensor-parallel-size" not in layout.flags(4)
    assert Layout(tp=2, dp=4, ep=4, etp=1).flags(4)[-2:] == ["--expert-tensor-parallel-size", "1"]
    config = pretrain_config(layout, MIXTRAL, 8)
    assert config.parallel.expert_model_parallel_size == 4
    assert layout.expert_dp == 1


def test_all_to_all_volume_and_link():
    from megapp.planning.hardware import PROFILES
    from megapp.planning.layer_costs import all_to_all_bytes, moe_layer_seconds

    config = GPTConfig(
        **{**MOE, "params_dtype": torch.bfloat16},
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=4,
    )
    # s = 32 tokens × b = 2, split over tp 2 under sequence parallelism, k = 2 copies of h = 64
    assert all_to_all_bytes(config, 32, 2) == 32 * 2 // 2 * 2 * 64 * 2
    h100 = PROFILES["h100"]
    nvlink = 3 * (
        h100.intra_node_latency + all_to_all_bytes(config, 32, 2) / 4 / h100.intra_node_bandwidth
    )
    # dispatch and combine over etp × ep = 8 ranks: one node
    assert moe_layer_seconds(config, 32, 2, h100)[1] == 2 * nvlink
    # etp 2 × ep 8 = 16 ranks over two nodes, 4 members on each: the 4 on the other node
    # over InfiniBand while the 3 on this one go over NVLink
    wide = dataclasses.replace(config, expert_model_parallel_size=8)
    share = all_to_all_bytes(wide, 32, 2) / 8
    remote = 4 * (h100.inter_node_latency + share / h100.inter_node_bandwidth)
    assert remote > 3 * (h100.intra_node_latency + share / h100.intra_node_bandwidth)
    assert moe_layer_seconds(wide, 32, 2, h100)[1] == pytest.approx(2 * remote, rel=1e-12)


def test_a_moe_layers_parts_add_up_to_what_the_time_model_charges():
    """By kind of work, a mixture-of-experts layer's device seconds sum, pass by pass, to
    its priced compute (the host's launches below it) plus its memory-bound passes; a
    profile without operation rates has no parts to give."""
    from megapp.planning.hardware import PROFILES
    from megapp.planning.layer_costs import (
        moe_compute_seconds,
        moe_layer_parts,
        moe_memory_seconds,
    )

    wide = dict(hidden_size=2048, num_attention_heads=16, moe_ffn_hidden_size=768)
    config = GPTConfig(
        **{**MOE, **wide, "params_dtype": torch.bfloat16, "max_position_embeddings": 2048},
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
    )
    hardware = PROFILES["h100-ops"]  # 2048 tokens of width 2048: the device outlasts the host
    parts = moe_layer_parts(config, 2048, 1, hardware)
    f, i, w = (sum(column) for column in zip(*parts.values(), strict=True))
    compute = moe_compute_seconds(config, 2048, 1, hardware, dense=None)
    memory_f, memory_b = moe_memory_seconds(config, 2048, 1, hardware)
    assert f == pytest.approx(compute.forward + memory_f, rel=1e-9)
    assert i == pytest.approx(compute.input_grad + memory_b, rel=1e-9)
    assert w == pytest.approx(compute.weight_grad, rel=1e-9)
    assert parts["attention"][2] == 0.0 and parts["grad_accumulation"][2] > 0
    with pytest.raises(ValueError, match="no operation rates"):
        moe_layer_parts(config, 2048, 1, PROFILES["h100"])


def test_an_all_to_all_across_nodes_is_as_slow_as_its_remote_shares():
    from megapp.planning.hardware import PROFILES, all_to_all_seconds, group_link

    h100 = PROFILES["h100"]
    nvlink = group_link(h100, 8).all_to_all(1e9, 8)
    assert all_to_all_seconds(h100, 1e9, 8, 8) == nvlink
    assert all_to_all_seconds(h100, 1e9, 4, 8) == group_link(h100, 8).all_to_all(1e9, 4)
    # 32 ranks on 4 nodes: 24 remote shares over InfiniBand, not 31
    infiniband = group_link(h100, 32)
    expected = 24 * (infiniband.latency + 1e9 / 32 / infiniband.bandwidth)
    assert all_to_all_seconds(h100, 1e9, 32, 32) == pytest.approx(expected, rel=1e-12)
    assert all_to_all_seconds(h100, 1e9, 32, 32) < infiniband.all_to_all(1e9, 32)
    # one member per node (a group strided over nodes): every share remote
    spread = all_to_all_seconds(h100, 1e9, 4, 32)
    assert spread == pytest.approx(infiniband.all_to_all(1e9, 4), rel=1e-12)
    assert all_to_all_seconds(h100, 1e9, 1, 32) == 0.0


def test_hierarchical_dispatch_is_priced_by_the_rows_it_sends():
    """16 experts on 8 ranks of 2-GPU nodes (4 nodes), 4 per token: the rows a token sends
    across nodes and within a node, averaged over every choice of its experts, priced over
    InfiniBand, then NVLink; fewer bytes cross InfiniBand than the flat all-to-all sends."""
    import dataclasses
    import itertools

    from megapp.planning.hardware import PROFILES, all_to_all_seconds
    from megapp.planning.layer_costs import hierarchical_dispatch_seconds, missed

    hardware = dataclasses.replace(
        PROFILES["h100"], gpus_per_node=2, inter_node_latency=0.0, intra_node_latency=0.0
    )
    sizes = dict(num_moe_experts=16, moe_router_topk=4, expert_model_parallel_size=8)
    gpt = GPTConfig(**dict(MOE, **sizes, expert_tensor_parallel_size=1))
    me, choices = 0, list(itertools.combinations(range(16), 4))
    rank = [e // 2 for e in range(16)]  # two experts a rank, two ranks a node
    across = sum(len({rank[e] // 2 for e in c} - {me // 2}) for c in choices) / len(choices)
    # within a node, every node's arrived rows (one per token that needs it) to its ranks
    within = sum(
        len({rank[e] for e in c if rank[e] // 2 == node} - {2 * node}) for c in choices
        for node in range(4)
    ) / len(choices)  # fmt: skip
    assert missed(16, 4, 4) == pytest.approx(
        sum(not set(c) & {0, 1, 2, 3} for c in choices) / len(choices)
    )
    row = 1e6  # bytes of one token's row; R = k rows
    expected = across * row / hardware.inter_node_bandwidth
    expected += within * row / hardware.intra_node_bandwidth
    seconds = hierarchical_dispatch_seconds(gpt, 4 * row, hardware)
    assert seconds == pytest.approx(expected, rel=1e-12)
    flat = all_to_all_seconds(hardware, 4 * row, 8, 8)
    assert across * row / hardware.inter_node_bandwidth < flat


def _planner_base(name: str) -> GPTConfig:
    from megapp.planning.models import MODELS

    model = MODELS[name]
    return pretrain_config(Layout(), model.flags, 1).gpt_config(model.vocab_size)


def test_the_search_yields_expert_layouts_for_moe_models_only():
    from megapp.planning.layout_space import Space, layouts

    space = Space(max_micro_batch_size=1, max_chunks=1, schedules=("1f1b",))
    mixtral = {layout.ep for layout in layouts(_planner_base("mixtral-8x7b"), 16, 8, 16, space)}
    assert mixtral == {1, 2, 4, 8}
    dense = {layout.ep for layout in layouts(_planner_base("llama3-8b"), 16, 8, 16, space)}
    assert dense == {1}
    chosen = Space(max_micro_batch_size=1, max_chunks=1, schedules=("1f1b",), ep=(2, 3))
    assert {layout.ep for layout in layouts(_planner_base("mixtral-8x7b"), 16, 8, 16, chosen)} == {
        2
    }


class OperandBytes(TorchDispatchMode):
    """Bytes of the operands (inputs and outputs) of every operation but matmuls, views,
    collectives and bare allocations; a zeroed buffer counts its output alone."""

    SKIP: ClassVar = {"mm", "addmm", "bmm", "_grouped_mm", "randn_like"}
    SKIP |= {"empty", "empty_like", "new_empty", "empty_strided"}  # allocate, write nothing
    FRESH: ClassVar = {"new_zeros", "zeros", "zeros_like"}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        schema = func._schema
        views = any(a.alias_info is not None and not a.alias_info.is_write for a in schema.returns)
        if name in self.SKIP or views or func.namespace == "c10d":
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [] if name in self.FRESH else tree_flatten((args, kwargs))[0]
        tensors = outs + [t for t in ins if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _moe_pass_bytes(gpt: GPTConfig, tokens: int, group=None) -> tuple[int, int]:
    """The operand bytes of one MoE layer's forward and backward over ``tokens`` tokens."""
    from megapp.moe.layer import MoELayer

    torch.manual_seed(5)
    layer = MoELayer(gpt.moe_config(), ep_group=group)
    x = torch.randn(tokens, 1, gpt.hidden_size, dtype=gpt.params_dtype, requires_grad=True)
    grad = torch.randn(tokens, 1, gpt.hidden_size, dtype=gpt.params_dtype)
    with OperandBytes() as forward:
        y, _ = layer(x)
    with OperandBytes() as backward:
        y.backward(grad)
    return forward.bytes, backward.bytes


MOE_PASSES = dict(
    MOE,
    hidden_size=512,  # wide against the routing's [T, E] scores, as a priced model is
    ffn_hidden_size=768,
    moe_ffn_hidden_size=384,
    params_dtype=torch.bfloat16,
    moe_grouped_gemm=True,
    add_bias_linear=False,
)


@pytest.mark.parametrize("topk, activation", [(2, "swiglu"), (8, "swiglu"), (4, "gelu")])
def test_the_moe_layers_memory_bound_passes_move_the_bytes_priced(topk, activation):
    """Every operand megapp's MoE layer reads and writes outside its matmuls, counted as it
    runs on one rank, against moe_memory_bytes: within 2% (the routing's [T, E] and [T, k]
    tensors are left out of the price)."""
    from megapp.planning.layer_costs import moe_memory_bytes

    gpt = GPTConfig(**dict(MOE_PASSES, moe_router_topk=topk, activation=activation))
    measured = _moe_pass_bytes(gpt, 256)
    forward, backward, _, _ = moe_memory_bytes(gpt, 256, 1)
    assert forward == pytest.approx(measured[0], rel=0.02)
    assert backward == pytest.approx(measured[1], rel=0.02)


@distributed(world_size=2)
def test_expert_parallelism_adds_its_buffers_to_the_priced_passes():
    """With ep 2 the received rows reordered by expert and placed back, both ways: within
    5% of the count (a rank receives more or fewer rows than the balanced share the price
    assumes)."""
    import torch.distributed as dist

    from megapp.planning.layer_costs import moe_memory_bytes

    gpt = GPTConfig(**dict(MOE_PASSES, moe_router_topk=4, expert_model_parallel_size=2))
    measured = _moe_pass_bytes(gpt, 2048, dist.group.WORLD)
    forward, backward, _, _ = moe_memory_bytes(gpt, 2048, 1)
    assert forward == pytest.approx(measured[0], rel=0.05), (forward, backward, measured)
    assert backward == pytest.approx(measured[1], rel=0.05)


def _kept_bytes(gpt: GPTConfig, tokens: int, ep_group=None) -> int:
    """Bytes of every storage a MoE layer saves for its backward, less its weights and its
    input, over ``tokens`` tokens."""
    from megapp.moe.layer import MoELayer

    torch.manual_seed(5)
    layer = MoELayer(gpt.moe_config(), ep_group=ep_group)
    x = torch.randn(tokens, 1, gpt.hidden_size, dtype=gpt.params_dtype, requires_grad=True)
    held = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    held.add(x.untyped_storage().data_ptr())
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values())


def _dense_mlp_output(gpt: GPTConfig, tokens: int) -> int:
    gated = 2 if gpt.activation == "swiglu" else 1
    return tokens * gpt.ffn_hidden_size * gated * gpt.params_dtype.itemsize


@pytest.mark.parametrize("dtype, activation", [(torch.bfloat16, "swiglu"), (torch.float32, "gelu")])
def test_the_moe_layers_kept_activations_are_the_priced_ones(dtype, activation):
    """The tensors megapp's MoE layer keeps for its backward (every storage saved, less its
    weights and its input), against moe_activation_bytes with the dense MLP's output it
    takes off added back: within 1% (the routing's indices are left out of the price)."""
    from megapp.planning.activations import moe_activation_bytes

    gpt = GPTConfig(**dict(MOE_PASSES, activation=activation, params_dtype=dtype))
    priced = moe_activation_bytes(gpt, 256, 1) + _dense_mlp_output(gpt, 256)
    assert priced == pytest.approx(_kept_bytes(gpt, 256), rel=0.01)


@distributed(world_size=2)
def test_expert_parallelism_keeps_no_more_than_one_rank():
    """With ep 2 the all-to-alls' buffers keep only their indices for backward: the kept
    tensors are one rank's, as priced, within 2% (a rank's experts receive more or fewer
    rows than the balanced share the price assumes)."""
    import torch.distributed as dist

    from megapp.planning.activations import moe_activation_bytes

    gpt = GPTConfig(**dict(MOE_PASSES, moe_router_topk=2, expert_model_parallel_size=2))
    priced = moe_activation_bytes(gpt, 1024, 1) + _dense_mlp_output(gpt, 1024)
    assert priced == pytest.approx(_kept_bytes(gpt, 1024, dist.group.WORLD), rel=0.02)


def _forward_transient(layer, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The MoE layer's forward peak less what is live at its end, and its output. Every
    tensor alive before is held until the window closes (one freed inside it would count
    as transient)."""
    import gc

    from megapp.training.live_memory import LiveTensorMemory

    gc.collect()
    # by type: isinstance reads __class__, which a deprecated torch.distributed alias warns on
    alive = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]
    with LiveTensorMemory() as memory:
        output, _ = layer(x)
        gc.collect()
        memory.sweep()
    del alive
    return memory.peak - memory.current(), output


@distributed(world_size=2)
def test_a_moe_forward_holds_no_more_at_once_than_its_priced_working_memory():
    """Beyond what the layer keeps, a MoE layer's forward at ep 2 holds at most the
    working memory the planner prices for it (two buffers of the routed rows, and the
    layer's output): each buffer of the dispatch and the combine is freed once the next is
    made (before, the sent rows, the received and returned buffers and the experts' output
    lived to the end of the layer: 3 R·h·w more)."""

    import torch.distributed as dist

    from megapp.moe.layer import MoELayer
    from megapp.planning.activations import moe_routed_rows

    gpt = GPTConfig(**dict(MOE_PASSES, moe_router_topk=2, expert_model_parallel_size=2))
    torch.manual_seed(5)
    layer = MoELayer(gpt.moe_config(), ep_group=dist.group.WORLD)
    tokens, h, w = 1024, gpt.hidden_size, gpt.params_dtype.itemsize
    x = torch.randn(tokens, 1, h, dtype=gpt.params_dtype, requires_grad=True)

    def transient() -> int:
        held, output = _forward_transient(layer, x)
        assert output.shape == x.shape
        return held

    # gloo's worker thread may hold a finished all-to-all's buffers a moment after the
    # call returns, so one forward can count a buffer the layer has let go: the least of
    # three is the layer's own
    held = min(transient() for _ in range(3))
    priced = 2 * moe_routed_rows(gpt, tokens, 1) * h * w + tokens * h * w
    # within 1%: the routing's [T, k] and [T, E] tensors are left out of the price
    assert 0 < held <= 1.01 * priced, (held, priced)


def test_the_experts_biases_add_into_their_rows_in_the_priced_working_memory():
    """With biases, a SwiGLU expert layer's forward peaks when the first bias, repeated to
    the rows, is added into the first matmul's output: the priced forward working memory
    (that copy, less the pair-order rows and the output, which are made after it) equals
    the peak above what the forward leaves held, within 1% (the routing's [T, k] tensors).
    Adding a bias to a copy of the rows, as before, took one more [R, 2f] at that moment."""

    from megapp.moe.layer import MoELayer
    from megapp.pipeline_parallel.schedules import Op
    from megapp.planning.memory import chunk_working_bytes

    gpt = GPTConfig(**dict(MOE, hidden_size=128, moe_ffn_hidden_size=256, moe_layer_freq=1))
    torch.manual_seed(5)
    layer = MoELayer(gpt.moe_config())
    tokens = 256
    for _ in range(2):  # the second forward, once every lazy buffer exists
        x = torch.randn(tokens, 1, gpt.hidden_size, requires_grad=True)
        transient, out = _forward_transient(layer, x)
        out.sum().backward()
    priced = chunk_working_bytes(gpt, 1, False, Op.FORWARD, tokens, 1)
    # the layer's output is the last thing made: the peak came before it existed
    assert transient + out.nbytes == pytest.approx(priced, rel=0.01)
