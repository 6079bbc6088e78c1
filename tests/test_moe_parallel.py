"""Expert parallelism against the single-process layer.

Every rank of an expert-parallel group routes its own batch. The reference is the
single-process layer (every expert, same seed, hence same weights) run on each member's
batch in turn, its gradients summed over them: the expert-parallel output of each rank
must equal the reference's output for that rank's batch, the input gradient likewise, each
rank's expert gradients the reference's for those experts, and the router's and shared
expert's gradients, summed over the group as data parallelism would, the reference's.
Float64, 1e-10 relative / 1e-12 absolute: the two differ only in the order of sums.

The all-to-all layout is checked first in one process, by simulating the exchange.
"""

import pytest
import torch
import torch.distributed as dist

from megapp import comm
from megapp import parallel_state as ps
from megapp.moe import MoEConfig, MoELayer
from megapp.moe.hierarchical import fan_out
from megapp.moe.permutation import all_to_all_plan
from megapp.param_attributes import shard
from megapp.testing import distributed

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}
S, B, H, E, FFN = 6, 2, 8, 8, 8


def _config(**overrides) -> MoEConfig:
    settings = dict(
        hidden_size=H,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=2,
        moe_aux_loss_coeff=0.1,
        params_dtype=F64,
        init_method_std=0.5,
    )
    settings.update(overrides)
    return MoEConfig(**settings)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----- the all-to-all layout, simulated in one process -------------------------------


@pytest.mark.parametrize("ep", [1, 2, 3, 4])
def test_all_to_all_plan_delivers_every_pair_and_back(ep):
    """Each rank sends its sorted pairs as they are, slice j to rank j, exactly the pairs
    for rank j's experts (no padding); each receiver takes every pair for its experts out
    in expert-major order, nothing else."""
    local = 2
    generator = torch.Generator().manual_seed(ep)
    counts = torch.randint(0, 4, (ep, ep * local), generator=generator)
    counts[0] = 0  # a rank that sends nothing
    plans = [all_to_all_plan(counts, r) for r in range(ep)]
    # each rank's sorted pairs, labelled (source, expert, index among source's pairs to it)
    labels = [
        [(src, e, i) for e in range(ep * local) for i in range(int(counts[src, e]))]
        for src in range(ep)
    ]
    assert all(p.total == int(counts.sum()) for p in plans)
    slices = []  # slices[src][dst]: what src sends to dst
    for src in range(ep):
        assert sum(plans[src].send_splits) == len(labels[src])
        ends = torch.tensor(plans[src].send_splits).cumsum(0).tolist()
        slices.append([labels[src][a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)])
    for dst in range(ep):
        assert plans[dst].recv_splits == [plans[src].send_splits[dst] for src in range(ep)]
        # the all-to-all: slice dst of every source, in source order
        received = [label for src in range(ep) for label in slices[src][dst]]
        rows = [received[r] for r in plans[dst].recv_rows.tolist()]
        expected = [
            (src, e, i)
            for e in range(dst * local, (dst + 1) * local)
            for src in range(ep)
            for i in range(int(counts[src, e]))
        ]
        assert rows == expected  # every pair for dst's experts, expert-major, nothing else
        assert sorted(plans[dst].recv_rows.tolist()) == list(range(len(received)))
        assert (
            plans[dst].tokens_per_local_expert
            == counts[:, dst * local : (dst + 1) * local].sum(0).tolist()
        )


def test_fan_out_sends_a_row_once_per_distinct_key():
    """Rows to keys (nodes or ranks): one pair per row and distinct valid key, sorted by
    key then row, with the row's slots of that key; a row with no valid slot sends none."""
    keys = torch.tensor([[0, 0], [1, 0], [1, 1], [2, 0]])
    valid = torch.tensor([[True, True], [True, True], [True, False], [False, False]])
    rows, key, slots, per_key = fan_out(keys, valid, 3)
    assert list(zip(key.tolist(), rows.tolist(), strict=True)) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    assert slots.tolist() == [[True, True], [False, True], [True, False], [True, False]]
    assert per_key.tolist() == [2, 2, 0]


# ----- on gloo ranks -----------------------------------------------------------------


CASES = {
    "dropless-swiglu-z-loss": dict(moe_z_loss_coeff=1e-2),
    "capacity-shared-gate": dict(
        moe_expert_capacity_factor=0.8,
        moe_shared_expert_intermediate_size=4,
        moe_shared_expert_gate=True,
    ),
    "sigmoid-bias-top3-gelu": dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk=3,
        activation="gelu",
        add_bias_linear=True,
        moe_router_load_balancing_type="seq_aux_loss",
    ),
    # the bias sends every pair to experts 0 and 1: the other ranks' experts get nothing
    "all-to-rank-0": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}


def _layers(config_one, config_ep, ep_group, etp_group, case):
    torch.manual_seed(0)
    whole = MoELayer(config_one)
    torch.manual_seed(0)
    part = MoELayer(config_ep, ep_group=ep_group, etp_group=etp_group)
    etp, etp_rank = comm.world_size(etp_group), comm.rank(etp_group)
    stride = 2 if config_one.activation == "swiglu" else 1
    for layer in (whole, part):
        with torch.no_grad():
            experts, first = layer.experts, layer.experts.first
            for bias, width, parts in [
                (experts.fc1_bias, config_one.fc1_width, stride),
                (experts.fc2_bias, H, 0),
            ]:
                if bias is not None:  # nonzero, each rank its experts' share
                    full = _randn(E, width, seed=7)[first : first + bias.shape[0]]
                    if parts and layer is part:
                        full = shard(full, 1, etp_rank, etp, parts)
                    bias.copy_(full)
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.copy_(_randn(E, seed=8) * 0.3)
                if case == "all-to-rank-0":
                    layer.router.expert_bias[:2] = 100.0
    return whole, part


def _summed(t, group):
    t = t.clone()
    comm.all_reduce(t, group)
    return t


def _check_expert_parallel(ep, dispatcher, case, tp=1, etp=None, node_size=None):
    grid = ps.initialize_model_parallel(
        tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    ep_group = ps.get_expert_model_parallel_group()
    etp_group = ps.get_expert_tensor_parallel_group()
    exchange = ps.get_expert_tensor_and_model_parallel_group()  # every rank a token may visit
    members = ps.get_group_ranks("tp_ep")
    me = members.index(dist.get_rank())
    overrides = CASES[case]
    config_ep = _config(
        **overrides,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=grid.etp,
        moe_token_dispatcher_type=dispatcher,
        moe_dispatch_node_size=node_size,
    )
    whole, part = _layers(_config(**overrides), config_ep, ep_group, etp_group, case)
    assert type(part.dispatcher).__name__.lower().startswith(dispatcher.replace("_", ""))
    batches = [_randn(S, B, H, seed=100 + r) for r in members]
    grads = [_randn(S, B, H, seed=200 + r) for r in members]
    # the reference: every member's batch through the whole layer, gradients summed
    outputs, input_grads, losses = [], [], []
    for x, g in zip(batches, grads, strict=True):
        x = x.clone().requires_grad_()
        out, _ = whole(x)
        (out * g).sum().backward()
        outputs.append(out.detach())
        input_grads.append(x.grad)
        losses.append(dict(whole.losses))
    x = batches[me].clone().requires_grad_()
    out, _ = part(x)
    (out * grads[me]).sum().backward()
    torch.testing.assert_close(out, outputs[me], **TOL)
    torch.testing.assert_close(x.grad, input_grads[me], **TOL)
    assert part.losses.keys() == losses[me].keys()
    for name, value in part.losses.items():
        torch.testing.assert_close(value, losses[me][name], **TOL)
    local = slice(part.experts.first, part.experts.first + E // ep)
    etp_rank, stride = (
        ps.get_expert_tensor_parallel_rank(),
        2 if part.config.activation == "swiglu" else 1,
    )
    # each expert's shard: fc1 (and its bias) by columns, fc2 by rows, fc2's bias whole
    for name, dim, parts in [
        ("fc1", 2, stride),
        ("fc2", 1, 1),
        ("fc1_bias", 1, stride),
        ("fc2_bias", 1, 0),
    ]:
        mine, theirs = getattr(part.experts, name), getattr(whole.experts, name)
        if mine is None:
            continue
        expected = theirs.grad[local]
        if parts:
            expected = shard(expected, dim, etp_rank, grid.etp, parts)
        torch.testing.assert_close(mine.grad, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    replicated = [("router.weight", part.router.weight, whole.router.weight)]
    if part.shared_expert is not None:
        replicated += [
            (name, p, dict(whole.shared_expert.named_parameters())[name])
            for name, p in part.shared_expert.named_parameters()
        ]
    for name, mine, theirs in replicated:
        summed = _summed(mine.grad, exchange)
        torch.testing.assert_close(summed, theirs.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if case == "all-to-rank-0":  # the case routes as it says
        routing = whole.router(batches[me].reshape(-1, H))
        assert set(routing.experts.unique().tolist()) == {0, 1}
    ps.destroy_model_parallel()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@distributed(world_size=2)
def test_two_expert_parallel_ranks_equal_one_process(dispatcher, case):
    _check_expert_parallel(2, dispatcher, case)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("node_size", [1, 2])
@distributed(world_size=2)
def test_hierarchical_dispatch_equals_one_process(node_size, case):
    """Node-deduplicated dispatch on two ranks, as two nodes of one rank (every token
    crosses once per node it needs) and as one node of two."""
    _check_expert_parallel(2, "hierarchical", case, node_size=node_size)


@pytest.mark.parametrize("node_size", [1, 2, 4])
@distributed(world_size=4)
def test_hierarchical_dispatch_on_four_ranks_equals_one_process(node_size):
    """Four expert-parallel ranks as four nodes, two nodes of two (both steps carry rows)
    and one node."""
    for case in ("dropless-swiglu-z-loss", "capacity-shared-gate", "all-to-rank-0"):
        _check_expert_parallel(4, "hierarchical", case, node_size=node_size)


@distributed(world_size=4)
def test_hierarchical_dispatch_crosses_to_a_node_once_per_token():
    """Two nodes of two ranks, 8 experts, 4 per token: a token leaves for the other node
    once if it chose any expert there; the flat dispatcher sends one row per such expert."""
    from megapp.moe.dispatch import AllToAllDispatcher
    from megapp.moe.hierarchical import HierarchicalDispatcher
    from megapp.moe.router import Routing

    rank, tokens = dist.get_rank(), 32
    generator = torch.Generator().manual_seed(rank)
    experts = torch.stack([torch.randperm(8, generator=generator)[:4] for _ in range(tokens)])
    routing = Routing(torch.rand(tokens, 4, generator=generator), experts, None, None)
    x = torch.randn(tokens, H, generator=generator)
    steps = HierarchicalDispatcher(8, dist.group.WORLD, 2).dispatch(x, routing).steps
    node = experts // 2 // 2  # expert -> rank -> node
    other = 1 - rank // 2
    leaving = steps[0].send_splits[other * 2 + rank % 2]
    assert leaving == int((node == other).any(dim=1).sum())
    flat = AllToAllDispatcher(8, dist.group.WORLD).dispatch(x, routing).plan.send_splits
    assert sum(flat[other * 2 : other * 2 + 2]) == int((node == other).sum()) > leaving


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@distributed(world_size=4)
def test_four_ranks_equal_one_process(ep, dispatcher):
    # ep 2: two expert-parallel groups of two side by side; ep 4: one group of four
    for case in ("dropless-swiglu-z-loss", "capacity-shared-gate", "all-to-rank-0"):
        _check_expert_parallel(ep, dispatcher, case)


@pytest.mark.parametrize(
    "tp, ep, etp",
    [
        (2, 1, None),  # each expert split over the tp ranks (etp = tp), all experts on each
        (4, 1, None),
        (2, 2, None),  # 2 × 2: experts over ep, each split over etp
        (2, 2, 1),  # experts whole, the tp ranks exchange tokens as ep ranks
    ],
)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@distributed(world_size=4)
def test_expert_tensor_parallel_equals_one_process(tp, ep, etp, dispatcher):
    """Each rank of the token-exchange group (tp_ep) holds its own tokens, as with sequence
    parallelism; experts split over etp ranks give the single-process layer's numbers."""
    for case in ("dropless-swiglu-z-loss", "sigmoid-bias-top3-gelu", "all-to-rank-0"):
        _check_expert_parallel(ep, dispatcher, case, tp=tp, etp=etp)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
@distributed(world_size=2)
def test_sequence_split_over_ranks_equals_whole_sequences(kind):
    """Two ranks holding halves of the same sequences (as sequence or context parallelism
    leaves them), experts split over the same two ranks: the losses count the tokens of
    both halves, so the two ranks' losses add up to the whole sequences' loss, and their
    summed router gradient is the whole's."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    overrides = dict(moe_router_load_balancing_type=kind, moe_z_loss_coeff=1e-2)
    torch.manual_seed(0)
    whole = MoELayer(_config(**overrides))
    torch.manual_seed(0)
    config = _config(**overrides, expert_model_parallel_size=2)
    part = MoELayer(config, ep_group=group, sequence_group=group)
    x_all, g_all = _randn(2 * S, B, H, seed=5), _randn(2 * S, B, H, seed=6)
    x_ref = x_all.clone().requires_grad_()
    out_ref, _ = whole(x_ref)
    (out_ref * g_all).sum().backward()
    half = slice(rank * S, (rank + 1) * S)
    x = x_all[half].clone().requires_grad_()
    out, _ = part(x)
    (out * g_all[half]).sum().backward()
    torch.testing.assert_close(out, out_ref[half], **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad[half], **TOL)
    torch.testing.assert_close(
        _summed(part.router.weight.grad, group), whole.router.weight.grad, **TOL
    )
    balance = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    torch.testing.assert_close(_summed(part.losses[balance], group), whole.losses[balance], **TOL)
    # each rank's z-loss is the mean over its half: their mean is the whole's
    torch.testing.assert_close(
        _summed(part.losses["z_loss"], group) / 2, whole.losses["z_loss"], **TOL
    )
    local = slice(part.experts.first, part.experts.first + E // 2)
    torch.testing.assert_close(part.experts.fc1.grad, whole.experts.fc1.grad[local], **TOL)


@distributed(world_size=2)
def test_expert_parallel_layer_needs_its_group():
    with pytest.raises(
        ValueError, match="expert_model_parallel_size is 1 but the expert-parallel group has 2"
    ):
        MoELayer(_config(), ep_group=dist.group.WORLD)
