"""ProcessGrid: golden layouts written by hand, properties over many layouts, and every
group against Megatron-Core's own rank generator."""

import functools
import itertools
import math
import re
import subprocess
import sys
import warnings

import pytest

from megapp import parallel_state
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
    assert grid.coords(13) == {"tp": 1, "cp": 0, "dp": 0, "pp": 3}
    assert grid.rank(tp=1, cp=0, dp=0, pp=3) == 13
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
    assert grid.coords(6) == {"dp": 0, "tp": 1, "cp": 0, "pp": 1}


def test_golden_no_pipeline():
    grid = ProcessGrid(4, tensor_model_parallel_size=2)
    assert grid.groups("pp") == [[0], [1], [2], [3]]
    assert grid.groups("embedding") == [[0], [1], [2], [3]]  # one rank when pp = 1
    assert grid.groups("dp") == [[0, 2], [1, 3]]
    assert grid.next_pipeline_rank(2) == 2
    assert grid.is_first_stage(2) and grid.is_last_stage(2)


def test_golden_16_ranks_tp2_cp2_pp2():
    grid = ProcessGrid(16, 2, 2, context_parallel_size=2)
    assert (grid.tp, grid.cp, grid.dp, grid.pp) == (2, 2, 2, 2)
    assert grid.order == "tp-cp-dp-pp"
    assert grid.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert grid.groups("cp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert grid.groups("dp") == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
        [8, 12],
        [9, 13],
        [10, 14],
        [11, 15],
    ]
    assert grid.groups("pp") == [[r, r + 8] for r in range(8)]
    assert grid.groups("tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert grid.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    # one model copy: the tp ranks of both stages, for one (cp, dp) coordinate
    assert grid.groups("mp")[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert grid.coords(11) == {"tp": 1, "cp": 1, "dp": 0, "pp": 1}
    assert grid.rank(tp=1, cp=1, dp=0, pp=1) == 11
    assert grid.next_pipeline_rank(11) == 3


def test_orders_without_cp_insert_it_next_to_tp():
    # cp = 1: an order of the tp × dp × pp grid still works and lays out the same groups
    for old, completed in [
        ("tp-dp-pp", "tp-cp-dp-pp"),
        ("dp-tp-pp", "dp-tp-cp-pp"),
        ("pp-dp-tp", "pp-dp-tp-cp"),
    ]:
        grid = ProcessGrid(8, 2, 2, order=old)
        assert grid.order == completed
        assert grid == ProcessGrid(8, 2, 2, order=completed)
        assert grid.cp == 1 and grid.groups("cp") == [[r] for r in range(8)]
        assert grid.groups("tp_cp") == grid.groups("tp")
        assert grid.groups("dp_cp") == grid.groups("dp")
    assert ProcessGrid(8, 2, 2) == ProcessGrid(8, 2, 2, order="tp-dp-pp")


def test_virtual_pipeline_size_is_kept():
    grid = ProcessGrid(8, 1, 2, virtual_pipeline_model_parallel_size=2)
    assert grid.vpp == 2
    assert grid.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _layouts(max_world: int = 24, max_cp_world: int = 8):
    """(world, tp, cp, pp, order): every tp × pp layout up to ``max_world`` ranks in an
    order without cp (cp = 1 is inserted), and every tp × cp × pp layout with cp > 1 up to
    ``max_cp_world`` ranks in every order of the four dimensions."""
    old_orders = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
    orders = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]
    for world in range(1, max_world + 1):
        for tp, cp, pp in itertools.product(range(1, world + 1), repeat=3):
            if world % (tp * cp * pp):
                continue
            if cp == 1:
                yield from ((world, tp, 1, pp, order) for order in old_orders)
            elif world <= max_cp_world:
                yield from ((world, tp, cp, pp, order) for order in orders)


def _grid(world, tp, cp, pp, order):
    return ProcessGrid(world, tp, pp, order=order, context_parallel_size=cp)


LAYOUTS = list(_layouts())
SPLIT_THE_WORLD = ("tp", "cp", "pp", "dp", "mp", "tp_cp", "dp_cp")


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_groups_partition_the_world(name):
    for layout in LAYOUTS:
        world, pp = layout[0], layout[3]
        grid = _grid(*layout)
        groups = grid.groups(name)
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members)), (layout, name)
        assert all(len(g) == grid.size(name) for g in groups)
        assert all(g == sorted(g) for g in groups)
        if name in SPLIT_THE_WORLD:
            assert sorted(members) == list(range(world)), (layout, name)
        else:  # embedding groups live on the pipeline ends, one per pipeline
            assert len(groups) == world // pp


def test_groups_follow_coordinates():
    for layout in LAYOUTS:
        world = layout[0]
        grid = _grid(*layout)
        assert grid.dp == world // (grid.tp * grid.cp * grid.pp)
        coords = [grid.coords(r) for r in range(world)]
        # coordinates are a bijection with ranks
        assert len({tuple(sorted(c.items())) for c in coords}) == world
        assert all(grid.rank(**c) == r for r, c in enumerate(coords))
        for name in ("tp", "cp", "pp", "dp"):
            for group in grid.groups(name):
                # members share every coordinate but `name`, and cover all of `name`
                others = {tuple(v for k, v in coords[r].items() if k != name) for r in group}
                assert len(others) == 1
                assert sorted(coords[r][name] for r in group) == list(range(grid.size(name)))
        for rank in range(world):
            nxt, prv = grid.next_pipeline_rank(rank), grid.prev_pipeline_rank(rank)
            assert grid.prev_pipeline_rank(nxt) == rank and grid.next_pipeline_rank(prv) == rank
            assert grid.group_of("pp", nxt) == grid.group_of("pp", rank)


@pytest.mark.parametrize("name", ["mp", "tp_cp", "dp_cp"])
def test_composite_groups_vary_their_dimensions_only(name):
    along = {"mp": ("tp", "pp"), "tp_cp": ("tp", "cp"), "dp_cp": ("dp", "cp")}[name]
    for layout in LAYOUTS:
        grid = _grid(*layout)
        for group in grid.groups(name):
            coords = [grid.coords(r) for r in group]
            fixed = {tuple(c[n] for n in grid.dims if n not in along) for c in coords}
            varying = {tuple(c[n] for n in along) for c in coords}
            assert len(fixed) == 1, (layout, name, group)
            assert (
                len(varying)
                == len(group)
                == grid.size(name)
                == math.prod(grid.dims[n] for n in along)
            )


# Megatron-Core names the composite groups by their dimensions.
MEGATRON_TOKENS = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "pp": "pp",
    "tp_cp": "tp-cp",
    "dp_cp": "dp-cp",
    "mp": "tp-pp",
}


class _RememberedRanks:
    """A Megatron-Core RankGenerator that computes each of its group lists once: its
    arithmetic is slow, and the layouts below ask it for the same lists many times."""

    def __init__(self, generator):
        self._generator = generator
        self._ranks = {}

    def get_ranks(self, token):
        if token not in self._ranks:
            self._ranks[token] = self._generator.get_ranks(token)
        return self._ranks[token]


@pytest.fixture(scope="module")
def rank_generator():
    """Megatron-Core's RankGenerator, one per set of sizes and order."""
    with warnings.catch_warnings():  # it warns that Transformer Engine and Apex are missing
        warnings.simplefilter("ignore")
        module = pytest.importorskip("megatron.core.parallel_state")

    @functools.cache
    def generator(**sizes):
        return _RememberedRanks(module.RankGenerator(**sizes))

    return generator


@pytest.mark.parametrize("world", [16, 32])
def test_groups_equal_megatron_core_rank_generator(world, rank_generator):
    orders = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]
    checked = 0
    for tp, cp, pp in itertools.product((1, 2, 4), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for order in orders:
            grid = ProcessGrid(world, tp, pp, order=order, context_parallel_size=cp)
            megatron = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            for name, token in MEGATRON_TOKENS.items():
                ours = grid.groups(name)
                theirs = sorted(sorted(g) for g in megatron.get_ranks(token))
                assert ours == theirs, (world, tp, cp, pp, order, name)
            # Megatron's default embedding ranks: the first and last stage of each pipeline
            ends = sorted(sorted({g[0], g[-1]}) for g in megatron.get_ranks("pp"))
            assert grid.groups("embedding") == ends
            checked += 1
    assert checked == 24 * (23 if world == 16 else 26)
    # an order without cp: ours inserts cp after tp, Megatron-Core appends it; same groups
    for tp, pp in itertools.product((1, 2, 4), repeat=2):
        for order in itertools.permutations(("tp", "dp", "pp")):
            order = "-".join(order)
            grid = ProcessGrid(world, tp, pp, order=order)
            megatron = rank_generator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
            for name, token in MEGATRON_TOKENS.items():
                theirs = sorted(sorted(g) for g in megatron.get_ranks(token))
                assert grid.groups(name) == theirs, (world, tp, pp, order, name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=12, tensor_model_parallel_size=5), "12 is not divisible by"),
        (dict(world_size=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=4), "= 16"),
        (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
        (dict(world_size=4, tensor_model_parallel_size=0), "tensor_model_parallel_size must be"),
        (dict(world_size=4, pipeline_model_parallel_size=-2), "pipeline_model_parallel_size must"),
        (dict(world_size=4, order="tp-dp-ep"), "unknown: ['ep']"),
        (dict(world_size=4, order="tp-tp-pp"), "repeated: ['tp']"),
        (dict(world_size=4, order="tp-pp"), "missing: ['dp']"),
        (dict(world_size=4, order="tp-cp-dp-pp-cp"), "repeated: ['cp']"),
        (
            dict(world_size=4, order="tp-dp-pp", context_parallel_size=2),
            "order 'tp-dp-pp' does not name cp, but context_parallel_size is 2; add it",
        ),
        (dict(world_size=4, context_parallel_size=0), "context_parallel_size must be an integer"),
        (
            dict(world_size=12, tensor_model_parallel_size=2, context_parallel_size=4),
            "world_size 12 is not divisible by tensor_model_parallel_size × "
            "context_parallel_size × pipeline_model_parallel_size (2 × 4 × 1 = 8)",
        ),
        (
            dict(world_size=6, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            "world_size 6 is not divisible by tensor_model_parallel_size × "
            "pipeline_model_parallel_size (2 × 2 = 4); launch a multiple of 4 processes",
        ),
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
    with pytest.raises(ValueError, match="unknown group 'ep'"):
        grid.groups("ep")
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        grid.coords(4)
    with pytest.raises(ValueError, match="tp index 2 is outside"):
        grid.rank(tp=2, cp=0, dp=0, pp=0)
    with pytest.raises(ValueError, match="give one index per dimension"):
        grid.rank(tp=0, dp=0, pp=0)


def test_grid_is_immutable():
    grid = ProcessGrid(8, 2, 2)
    with pytest.raises(AttributeError):
        grid.world_size = 16
    assert grid == ProcessGrid(8, 2, 2)


def test_cli_prints_the_layout(capsys):
    parallel_state.main(["--world-size", "16", "--tp", "2", "--pp", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert "tp=2 × cp=1 × dp=2 × pp=4" in lines[0] and "order tp-cp-dp-pp" in lines[0]
    columns = re.split(r"\s{2,}", lines[1].strip())
    assert columns == [
        "rank",
        *("tp", "cp", "dp", "pp"),
        *("tp group", "cp group", "dp group", "pp group"),
        "embedding",
    ]
    # rank 13: tp 1, cp 0, dp 0, pp 3; tp group 12,13; cp group 13; dp group 13,15;
    # pp group 1,5,9,13; embedding 1,13
    assert lines[2 + 13].split() == [
        "13",
        "1",
        "0",
        "0",
        "3",
        "12,13",
        "13",
        "13,15",
        "1,5,9,13",
        "1,13",
    ]
    assert lines[2 + 5].split()[-1] == "-"  # a middle stage holds no embedding


def test_cli_prints_context_parallel_coordinates(capsys):
    parallel_state.main(["--world-size", "16", "--tp", "2", "--cp", "2", "--pp", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "tp=2 × cp=2 × dp=2 × pp=2" in lines[0]
    # rank 11: tp 1, cp 1, dp 0, pp 1; tp group 10,11; cp group 9,11; dp group 11,15;
    # pp group and embedding 3,11
    assert (
        lines[2 + 11].split() == ["11", "1", "1", "0", "1", "10,11", "9,11", "11,15"] + ["3,11"] * 2
    )


def test_cli_rejects_bad_layout(capsys):
    with pytest.raises(SystemExit) as exit_:
        parallel_state.main(["--world-size", "6", "--tp", "4"])
    assert exit_.value.code == 2
    assert "world_size 6 is not divisible" in capsys.readouterr().err


@pytest.mark.slow  # a Python process of its own; the test above calls the same main
def test_the_module_runs_as_a_program():
    # exit status 2 and the reason, as from main
    proc = subprocess.run(
        [sys.executable, "-m", "megapp.parallel_state", "--world-size", "6", "--tp", "4"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "world_size 6 is not divisible" in proc.stderr


# ----- the expert layout -------------------------------------------------------------


def test_golden_expert_layout_8_ranks_tp2_ep2_pp2():
    grid = ProcessGrid(8, 2, 2, expert_model_parallel_size=2)
    assert (grid.etp, grid.ep, grid.edp, grid.pp) == (2, 2, 1, 2)
    assert grid.expert_order == "tp-ep-dp-pp"
    assert grid.expert_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.expert_groups("expt_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.expert_groups("expt_dp") == [[r] for r in range(8)]
    assert grid.expert_groups("tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.expert_groups("tp_ep_pp") == [list(range(8))]
    assert grid.expert_coords(6) == {"expt_tp": 0, "ep": 1, "expt_dp": 0, "pp": 1}
    assert grid.expert_size("tp_ep") == 4 and grid.has_expert_layout


def test_golden_expert_layout_16_ranks_tp2_cp2_etp1_ep4():
    # dense: tp-cp-dp-pp = 2 × 2 × 4 × 1; experts: etp-ep-dp-pp = 1 × 4 × 4 × 1
    grid = ProcessGrid(
        16, 2, context_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1
    )
    assert (grid.etp, grid.ep, grid.edp) == (1, 4, 4)
    assert grid.expert_groups("ep") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    assert grid.expert_groups("expt_dp") == [[r, r + 4, r + 8, r + 12] for r in range(4)]
    assert grid.expert_groups("expt_tp") == [[r] for r in range(16)]
    # the 4 experts' owners are one tp × cp block of the dense layout
    assert grid.expert_groups("ep")[1] == grid.groups("tp_cp")[1]


def test_expert_layout_defaults_follow_the_dense_one():
    grid = ProcessGrid(8, 2, 2)
    assert (grid.etp, grid.ep, grid.edp) == (2, 1, 2) and not grid.has_expert_layout
    assert grid.expert_tensor_parallel_size == 2  # None becomes tp
    assert grid.expert_groups("expt_tp") == grid.groups("tp")
    assert grid.expert_groups("expt_dp") == grid.groups("dp")
    assert grid.expert_groups("tp_ep_pp") == grid.groups("mp")
    assert grid.expert_groups("ep") == [[r] for r in range(8)]
    assert grid == ProcessGrid(8, 2, 2, expert_tensor_parallel_size=2)


def _expert_layouts(world: int):
    """(tp, cp, pp, ep, etp, order) over sizes in {1, 2, 4} (ep also 8) and every order."""
    orders = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]
    for tp, cp, pp, ep, etp in itertools.product(
        (1, 2, 4), (1, 2), (1, 2, 4), (1, 2, 4, 8), (None, 1, 2, 4)
    ):
        if world % (tp * cp * pp) == 0 and (etp is None or etp <= world):
            yield from ((tp, cp, pp, ep, etp, order) for order in orders)


@pytest.mark.parametrize("world", [8, 16, 32])
def test_expert_groups_equal_megatron_core_rank_generator(world, rank_generator):
    """Every expert group against the expert RankGenerator that Megatron-Core's
    initialize_model_parallel builds (its order: ours with ep just before dp), and every
    layout with experts split that its initialize refuses (indivisible sizes, unequal
    pipeline groups, expert dp unlike dp with pp not last) refused here too."""
    megatron_tokens = {
        "ep": "ep",
        "expt_tp": "tp",
        "expt_dp": "dp",
        "tp_ep": "tp-ep",
        "tp_ep_pp": "tp-ep-pp",
    }
    accepted = refused = 0
    for tp, cp, pp, ep, etp, order in _expert_layouts(world):
        dp = world // (tp * cp * pp)
        megatron_order = order.replace("dp", "ep-dp")
        expert_tp = tp if etp is None else etp
        kwargs = dict(
            context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        if world % (expert_tp * ep * pp):
            with pytest.raises(ValueError, match="expert_tensor_parallel_size × expert_model"):
                ProcessGrid(world, tp, pp, order=order, **kwargs)
            refused += 1
            continue
        edp = world // (expert_tp * ep * pp)
        dense = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=megatron_order)
        expert = rank_generator(tp=expert_tp, ep=ep, dp=edp, pp=pp, cp=1, order=megatron_order)
        megatron_accepts = (
            megatron_order.endswith("pp") or pp == 1 or edp == dp
        ) and dense.get_ranks("pp") == expert.get_ranks("pp")
        # a layout without experts split (ep 1, etp = tp) stays valid for dense models
        if not megatron_accepts and (ep > 1 or expert_tp != tp):
            with pytest.raises(ValueError, match="expert layers"):
                ProcessGrid(world, tp, pp, order=order, **kwargs)
            refused += 1
            continue
        grid = ProcessGrid(world, tp, pp, order=order, **kwargs)
        assert (grid.etp, grid.ep, grid.edp) == (expert_tp, ep, edp)
        for name, token in megatron_tokens.items():
            theirs = sorted(sorted(g) for g in expert.get_ranks(token))
            assert grid.expert_groups(name) == theirs, (world, tp, cp, pp, ep, etp, order, name)
            assert all(len(g) == grid.expert_size(name) for g in theirs)
        accepted += 1
    assert accepted > 500 and refused > 50  # both sides of every rule were exercised


def test_expert_coordinates_are_a_bijection():
    for world, tp, cp, pp, ep, etp in [
        (16, 2, 2, 2, 2, 1),
        (32, 4, 1, 2, 4, 2),
        (8, 1, 2, 1, 8, 1),
    ]:
        grid = ProcessGrid(
            world,
            tp,
            pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        coords = [tuple(grid.expert_coords(r).values()) for r in range(world)]
        assert len(set(coords)) == world
        for name in ("ep", "expt_tp", "expt_dp"):
            for group in grid.expert_groups(name):
                # members differ only in `name` and cover all of it
                rest = {
                    tuple(v for k, v in grid.expert_coords(r).items() if k != name) for r in group
                }
                assert len(rest) == 1
                assert sorted(grid.expert_coords(r)[name] for r in group) == list(range(len(group)))
        # the pipeline is the same in both layouts
        assert all(grid.expert_coords(r)["pp"] == grid.coords(r)["pp"] for r in range(world))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, expert_model_parallel_size=3), "(1 × 3 × 1 = 3)"),
        (dict(world_size=8, expert_model_parallel_size=0), "expert_model_parallel_size must be"),
        (dict(world_size=8, expert_tensor_parallel_size=0), "expert_tensor_parallel_size must be"),
        (
            dict(
                world_size=8,
                pipeline_model_parallel_size=2,
                order="tp-cp-pp-dp",
                expert_model_parallel_size=2,
            ),
            "expert dp is 2 and dp is 4; put pp last",
        ),
        (
            dict(
                world_size=8,
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                order="tp-pp-dp",
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            ),
            "pipeline groups differ",
        ),
        (dict(world_size=4, order="tp-ep-dp-pp"), "ep is placed by the expert layout itself"),
    ],
)
def test_invalid_expert_layouts_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        ProcessGrid(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_expert_group_queries():
    grid = ProcessGrid(4, expert_model_parallel_size=2)
    with pytest.raises(
        ValueError, match="unknown group 'ep' \\(an expert group: use expert_groups"
    ):
        grid.groups("ep")
    with pytest.raises(ValueError, match="unknown expert group 'tp'; known expert groups: ep, "):
        grid.expert_groups("tp")
    assert grid.expert_group_of("ep", 3) == [2, 3]


def test_cli_prints_the_expert_layout(capsys):
    parallel_state.main(["--world-size", "8", "--tp", "2", "--ep", "2", "--pp", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "expert layers: etp=2 × ep=2 × expert dp=1 × pp=2, order tp-ep-dp-pp" in lines[1]
    assert re.split(r"\s{2,}", lines[2].strip())[-4:] == [
        "ep",
        "ep group",
        "expt_tp group",
        "expt_dp group",
    ]
    # rank 6: ep 1, ep group 4,6, expt_tp group 6,7, expt_dp group 6
    assert lines[3 + 6].split()[-4:] == ["1", "4,6", "6,7", "6"]
