"""initialize_model_parallel on real gloo processes: every group all-reduces over
exactly the ranks the grid says, for every (tp, pp) that fits 1, 2, 4 and 8 ranks."""

import pytest
import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.process_grid import CONTEXT_GROUPS, GROUP_NAMES
from megapp.testing import distributed

CASES = [
    (world, tp, pp)
    for world in (1, 2, 4, 8)
    for tp in (1, 2, 4, 8)
    for pp in (1, 2, 4, 8)
    if world % (tp * pp) == 0
]


def _check_layout(tp: int, pp: int, order: str = "tp-dp-pp", vpp: int | None = None) -> None:
    grid = ps.initialize_model_parallel(tp, pp, vpp, order=order)
    rank = dist.get_rank()
    for name in CONTEXT_GROUPS:  # a layout without context parallelism makes no cp groups
        with pytest.raises(RuntimeError, match=f"no '{name}' group"):
            ps.get_group(name)
    for name in (n for n in GROUP_NAMES if n not in CONTEXT_GROUPS):
        members = grid.group_of(name, rank)
        if not members:  # middle pipeline stages hold no embedding
            with pytest.raises(RuntimeError, match=f"no '{name}' group"):
                ps.get_group(name)
            continue
        # 2**rank summed over a group names its members exactly (float64 holds it exactly)
        token = torch.tensor([2.0**rank], dtype=torch.float64)
        dist.all_reduce(token, group=ps.get_group(name))
        assert token.item() == sum(2.0**r for r in members), (name, members)
        assert ps.get_group_ranks(name) == members
        assert dist.get_world_size(ps.get_group(name)) == len(members)
    coords = grid.coords(rank)
    assert ps.get_tensor_model_parallel_rank() == coords["tp"]
    assert ps.get_pipeline_model_parallel_rank() == coords["pp"]
    assert ps.get_data_parallel_rank() == coords["dp"]
    assert ps.get_tensor_model_parallel_world_size() == tp
    assert ps.get_pipeline_model_parallel_world_size() == pp
    assert ps.get_data_parallel_world_size() == dist.get_world_size() // (tp * pp)
    assert ps.get_tensor_model_parallel_src_rank() == grid.group_of("tp", rank)[0]
    assert ps.is_pipeline_first_stage() == (coords["pp"] == 0)
    assert ps.is_pipeline_last_stage(ignore_virtual=True) == (coords["pp"] == pp - 1)
    # with virtual stages the current chunk (0) is the last only when there is one chunk
    assert ps.is_pipeline_last_stage() == (coords["pp"] == pp - 1 and vpp in (None, 1))
    # the next/prev ranks are real neighbours: a ring shift along the pipeline
    token = torch.tensor([float(rank)])
    received = torch.zeros(1)
    ops = [
        dist.P2POp(dist.isend, token, ps.get_pipeline_model_parallel_next_rank()),
        dist.P2POp(dist.irecv, received, ps.get_pipeline_model_parallel_prev_rank()),
    ]
    if pp > 1:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        assert received.item() == grid.prev_pipeline_rank(rank)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


@pytest.mark.parametrize("world_size, tp, pp", CASES)
@distributed()
def test_groups_reduce_over_their_members(world_size, tp, pp):
    _check_layout(tp, pp)


@pytest.mark.parametrize("order", ["tp-pp-dp", "dp-tp-pp", "pp-dp-tp"])
@distributed(world_size=8)
def test_other_orders(order):
    _check_layout(2, 2, order=order)


@distributed(world_size=8)
def test_reinitialize_many_layouts_in_one_process():
    for tp, pp, vpp in [(2, 2, None), (1, 8, 2), (8, 1, None), (2, 4, 3), (1, 1, None)]:
        _check_layout(tp, pp, vpp=vpp)


@distributed(world_size=4)
def test_virtual_pipeline_getters():
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    stage = ps.get_pipeline_model_parallel_rank()
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() == (stage == 0)
    assert not ps.is_pipeline_last_stage()  # chunk 0 is never the last virtual stage
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert not ps.is_pipeline_first_stage()
    assert ps.is_pipeline_first_stage(ignore_virtual=True) == (stage == 0)
    assert ps.is_pipeline_last_stage() == (stage == 1)
    with pytest.raises(ValueError, match="virtual pipeline rank 2 is outside"):
        ps.set_virtual_pipeline_model_parallel_rank(2)


@distributed(world_size=2)
def test_misuse_raises_clear_errors():
    with pytest.raises(RuntimeError, match="not initialized; call initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
    with pytest.raises(ValueError, match="world_size 2 is not divisible"):
        ps.initialize_model_parallel(4)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(2)
    with pytest.raises(RuntimeError, match="already initialized; call destroy_model_parallel"):
        ps.initialize_model_parallel(1)
