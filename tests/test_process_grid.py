"""ProcessGrid: golden layouts written by hand, and properties over many layouts."""

import itertools
import subprocess
import sys

import pytest

from megapp.parallel_state import ProcessGrid
from megapp.process_grid import GROUP_NAMES


def test_golden_16_ranks_tp2_pp4():
    grid = ProcessGrid(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert (grid.tp, grid.dp, grid.pp) == (2, 2, 4)
    assert grid.groups("tp") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert grid.groups("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert grid.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.groups("mp") == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert grid.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert grid.groups("position_embedding") == [[0], [1], [2], [3]]
    assert grid.coords(13) == {"tp": 1, "dp": 0, "pp": 3}
    assert grid.rank(tp=1, dp=0, pp=3) == 13
    assert grid.next_pipeline_rank(13) == 1  # last stage wraps to the first
    assert grid.prev_pipeline_rank(13) == 9
    assert grid.next_pipeline_rank(5) == 9
    assert grid.prev_pipeline_rank(1) == 13
    assert grid.is_first_stage(3) and not grid.is_last_stage(3)
    assert grid.is_last_stage(14) and not grid.is_first_stage(14)


def test_golden_8_ranks_tp2_pp2_order_tp_pp_dp():
    grid = ProcessGrid(8, 2, 2, order="tp-pp-dp")
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("mp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.groups("embedding") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_golden_8_ranks_dp_fastest():
    grid = ProcessGrid(8, 2, 2, order="dp-tp-pp")
    assert grid.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.coords(6) == {"dp": 0, "tp": 1, "pp": 1}


def test_golden_no_pipeline():
    grid = ProcessGrid(4, tensor_model_parallel_size=2)
    assert grid.groups("pp") == [[0], [1], [2], [3]]
    assert grid.groups("embedding") == [[0], [1], [2], [3]]  # one rank when pp = 1
    assert grid.groups("dp") == [[0, 2], [1, 3]]
    assert grid.next_pipeline_rank(2) == 2
    assert grid.is_first_stage(2) and grid.is_last_stage(2)


def test_virtual_pipeline_size_is_kept():
    grid = ProcessGrid(8, 1, 2, virtual_pipeline_model_parallel_size=2)
    assert grid.vpp == 2
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _layouts(max_world: int = 24):
    orders = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world // tp + 1):
                if world % (tp * pp) == 0:
                    for order in orders:
                        yield world, tp, pp, order


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_groups_partition_the_world(name):
    for world, tp, pp, order in LAYOUTS:
        grid = ProcessGrid(world, tp, pp, order=order)
        groups = grid.groups(name)
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)), (world, tp, pp, order, name)
        assert all(len(g) == grid.size(name) for g in groups)
        assert all(g == sorted(g) for g in groups)
        if name in ("tp", "pp", "dp", "mp"):
            assert sorted(members) == list(range(world)), (world, tp, pp, order, name)
        else:  # embedding groups live on the pipeline ends, one per pipeline
            assert len(groups) == world // pp


def test_groups_follow_coordinates():
    for world, tp, pp, order in LAYOUTS:
        grid = ProcessGrid(world, tp, pp, order=order)
        coords = [grid.coords(r) for r in range(world)]
        # coordinates are a bijection with ranks
        assert len({tuple(sorted(c.items())) for c in coords}) == world
        assert all(grid.rank(**c) == r for r, c in enumerate(coords))
        for name in ("tp", "pp", "dp"):
            for group in grid.groups(name):
                # members share every coordinate but `name`, and cover all of `name`
                others = {tuple(v for k, v in coords[r].items() if k != name) for r in group}
                assert len(others) == 1
                assert sorted(coords[r][name] for r in group) == list(range(grid.size(name)))
        for rank in range(world):
            nxt, prv = grid.next_pipeline_rank(rank), grid.prev_pipeline_rank(rank)
            assert grid.prev_pipeline_rank(nxt) == rank and grid.next_pipeline_rank(prv) == rank
            assert grid.group_of("pp", nxt) == grid.group_of("pp", rank)


def test_mp_group_is_tp_times_pp():
    for world, tp, pp, order in LAYOUTS:
        grid = ProcessGrid(world, tp, pp, order=order)
        for group in grid.groups("mp"):
            dps = {grid.coords(r)["dp"] for r in group}
            assert len(dps) == 1 and len(group) == tp * pp


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=12, tensor_model_parallel_size=5), "12 is not divisible by"),
        (dict(world_size=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=4), "= 16"),
        (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
        (dict(world_size=4, tensor_model_parallel_size=0), "tensor_model_parallel_size must be"),
        (dict(world_size=4, pipeline_model_parallel_size=-2), "pipeline_model_parallel_size must"),
        (dict(world_size=4, order="tp-dp-cp"), "unknown: ['cp']"),
        (dict(world_size=4, order="tp-tp-pp"), "repeated: ['tp']"),
        (dict(world_size=4, order="tp-pp"), "missing: ['dp']"),
        (
            dict(world_size=4, virtual_pipeline_model_parallel_size=2),
            "needs pipeline parallelism, but pipeline_model_parallel_size is 1",
        ),
        (
            dict(
                world_size=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0
            ),
            "virtual_pipeline_model_parallel_size must be None or an integer >= 1",
        ),
    ],
)
def test_invalid_layouts_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        ProcessGrid(**kwargs)
    assert message in str(info.value)


def test_bad_queries_raise():
    grid = ProcessGrid(4, 2)
    with pytest.raises(ValueError, match="unknown group 'cp'"):
        grid.groups("cp")
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        grid.coords(4)
    with pytest.raises(ValueError, match="tp index 2 is outside"):
        grid.rank(tp=2, dp=0, pp=0)


def test_grid_is_immutable():
    grid = ProcessGrid(8, 2, 2)
    with pytest.raises(AttributeError):
        grid.world_size = 16
    assert grid == ProcessGrid(8, 2, 2)


def test_cli_prints_the_layout():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megapp.parallel_state",
            "--world-size",
            "16",
            "--tp",
            "2",
            "--pp",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert "tp=2 × dp=2 × pp=4" in lines[0]
    assert lines[1].split() == [
        "rank",
        "tp",
        "dp",
        "pp",
        "tp",
        "group",
        "dp",
        "group",
        "pp",
        "group",
        "embedding",
    ]
    # rank 13: tp 1, dp 0, pp 3; tp group 12,13; dp group 13,15; pp group 1,5,9,13; embedding 1,13
    assert lines[2 + 13].split() == ["13", "1", "0", "3", "12,13", "13,15", "1,5,9,13", "1,13"]
    assert lines[2 + 5].split()[-1] == "-"  # a middle stage holds no embedding


def test_cli_rejects_bad_layout():
    proc = subprocess.run(
        [sys.executable, "-m", "megapp.parallel_state", "--world-size", "6", "--tp", "4"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "world_size 6 is not divisible" in proc.stderr
