"""The expert layout's process groups on gloo: every expert group reduces over exactly the
ranks ProcessGrid.expert_groups names, the getters agree with the grid, a layout with no
experts split reuses the dense groups, and destroy_model_parallel frees each group once."""

import pytest
import torch
import torch.distributed as dist

from megapp import parallel_state as ps
from megapp.process_grid import EXPERT_GROUP_NAMES
from megapp.testing import distributed

GETTERS = {
    "ep": ps.get_expert_model_parallel_group,
    "expt_tp": ps.get_expert_tensor_parallel_group,
    "expt_dp": ps.get_expert_data_parallel_group,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
}


def _members(group) -> list[int]:
    """The global ranks of ``group``, read by an all-reduce of 2**rank (exact in float64)."""
    token = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)
    dist.all_reduce(token, group=group)
    bits = int(token.item())
    return [r for r in range(dist.get_world_size()) if bits >> r & 1]


def _check(tp: int, pp: int, ep: int, etp: int | None, cp: int = 1) -> None:
    grid = ps.initialize_model_parallel(
        tp,
        pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    rank = dist.get_rank()
    for name in EXPERT_GROUP_NAMES:
        expected = grid.expert_group_of(name, rank)
        group = GETTERS[name]()
        if name == "ep" and ep == 1:
            assert group is None  # no expert parallelism: no group, like cp = 1
            continue
        assert _members(group) == expected, (name, expected)
        assert ps.get_group_ranks(name) == expected
    coords = grid.expert_coords(rank)
    assert ps.get_expert_model_parallel_rank() == coords["ep"]
    assert ps.get_expert_model_parallel_world_size() == ep
    assert ps.get_expert_tensor_parallel_rank() == coords["expt_tp"]
    assert ps.get_expert_tensor_parallel_world_size() == grid.etp
    assert ps.get_expert_data_parallel_rank() == coords["expt_dp"]
    assert ps.get_expert_data_parallel_world_size() == grid.edp
    tp_ep = grid.expert_group_of("tp_ep", rank)
    assert ps.get_expert_tensor_and_model_parallel_rank() == tp_ep.index(rank)
    assert ps.get_expert_tensor_and_model_parallel_world_size() == len(tp_ep)
    ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "world_size, tp, pp, ep, etp",
    [
        (2, 1, 1, 2, None),
        (4, 1, 1, 4, None),
        (4, 2, 1, 2, None),
        (4, 2, 1, 2, 1),
        (4, 1, 2, 2, None),
        (4, 2, 1, 1, 1),
        (4, 1, 1, 2, 2),
    ],
)
@distributed()
def test_expert_groups_reduce_over_their_members(world_size, tp, pp, ep, etp):
    _check(tp, pp, ep, etp)


@distributed(world_size=4)
def test_expert_groups_with_context_parallel():
    _check(1, 1, 4, None, cp=2)  # ep spans the dp × cp ranks
    _check(2, 1, 2, 1, cp=2)


@distributed(world_size=4)
def test_no_expert_layout_reuses_the_dense_groups():
    ps.initialize_model_parallel(2, context_parallel_size=2)
    assert ps.get_expert_model_parallel_group() is None
    assert ps.get_expert_tensor_parallel_group() is ps.get_tensor_model_parallel_group()
    assert ps.get_expert_data_parallel_group() is ps.get_data_parallel_group_with_cp()
    assert ps.get_expert_tensor_and_model_parallel_group() is ps.get_tensor_model_parallel_group()
    ps.destroy_model_parallel()  # each group destroyed once although named twice
    ps.initialize_model_parallel(1, 2)
    assert ps.get_expert_data_parallel_group() is ps.get_data_parallel_group()
    assert ps.get_expert_tensor_model_pipeline_parallel_group() is ps.get_model_parallel_group()
    ps.destroy_model_parallel()
    # an expert layout whose groups equal dense ones names those (tp 2 × ep 2 = the world)
    ps.initialize_model_parallel(2, expert_model_parallel_size=2)
    assert ps.get_expert_tensor_parallel_group() is ps.get_tensor_model_parallel_group()
    assert ps.get_expert_model_parallel_group() is ps.get_data_parallel_group()
    ps.destroy_model_parallel()


@distributed(world_size=4)
def test_bad_expert_layout_raises_before_any_group():
    with pytest.raises(ValueError, match="not divisible by expert_tensor_parallel_size"):
        ps.initialize_model_parallel(1, expert_model_parallel_size=3)
    assert not ps.model_parallel_is_initialized()
