"""Context-parallel attention on gloo against full attention in one process.

Every rank builds the same full q, k, v and output gradient (float64, one seed),
runs the single-process attention on them as the reference, then context-parallel
attention on its own slice: its output slice and its slices of dQ/dK/dV must equal
the reference's. Context parallelism only regroups sums (blockwise softmax, partial
gradients added on other ranks), so 1e-10 relative / 1e-12 absolute is far above
float64 round-off and far below any real mistake (a wrong mask or a lost block
changes values at 1e-2).
"""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from megapp import comm
from megapp.context_parallel import COMM_TYPES, attention, blocks, layout
from megapp.context_parallel.a2a import kv_repeats
from megapp.process_grid import ProcessGrid
from megapp.testing import distributed

TOL = {"rtol": 1e-10, "atol": 1e-12}
F64 = torch.float64
B, D = 2, 8
HEADS = [(4, 4), (4, 2), (4, 1)]  # (query heads, key/value heads)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _reference(q, k, v, causal):
    """Plain softmax(q kᵀ/√d) v over the whole sequence, [b, heads, s, d]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(dim=-1) @ v


# ----- layout (one process) ---------------------------------------------------------


def test_load_balanced_chunks_golden():
    assert layout.chunks_of_rank(2, 0) == (0, 3) and layout.chunks_of_rank(2, 1) == (1, 2)
    assert layout.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert layout.positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert layout.positions(6, 1, 0).tolist() == list(range(6))
    x = torch.arange(8)
    assert layout.split(x, 2, 0).tolist() == [0, 1, 6, 7]
    assert layout.to_rank_order(x, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_merge_round_trip_and_positions(cp):
    s = 4 * cp
    positions = torch.arange(s)
    for shape, dim in [((s, 3), 0), ((2, s, 5), 1), ((2, 3, s, 4), 2), ((2, 3, s, 4), -2)]:
        x = _randn(*shape, seed=cp)
        slices = [layout.split(x, cp, r, dim=dim) for r in range(cp)]
        assert all(t.shape[dim] == s // cp for t in slices)
        assert torch.equal(layout.merge(slices, dim=dim), x)
        rank_order = layout.to_rank_order(x, cp, dim=dim)
        assert torch.equal(rank_order, torch.cat(slices, dim=dim))
        assert torch.equal(layout.restore_order(rank_order, cp, dim=dim), x)
    # every position exactly once, and each rank's ids are what split hands it
    ids = [layout.positions(s, cp, r) for r in range(cp)]
    assert sorted(torch.cat(ids).tolist()) == list(range(s))
    for r in range(cp):
        assert torch.equal(ids[r], layout.split(positions, cp, r))
    # causal work per rank (keys each token sees) is the same on every rank
    assert len({int((ids[r] + 1).sum()) for r in range(cp)}) == 1


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 × "):
        layout.split(torch.zeros(12), 4, 0)
    with pytest.raises(ValueError, match=r"\(2 × 4 = 8\); .* use a multiple of 8"):
        layout.positions(12, 4, 0)
    with pytest.raises(ValueError, match=r"cp rank 2 is outside \[0, 2\)"):
        layout.split(torch.zeros(8), 2, 2)


# ----- the blockwise arithmetic (one process) --------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialized"])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_merge_and_backward_equal_full_attention(causal, fused):
    heads, kv_heads, s = 4, 2, 12
    q = _randn(B, heads, s, D, seed=1)
    k, v = _randn(B, kv_heads, s, D, seed=2), _randn(B, kv_heads, s, D, seed=3)
    grad_out = _randn(B, heads, s, D, seed=4)
    scale = 1 / math.sqrt(D)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full, causal)
    expected.backward(grad_out)
    # the last 4 queries against keys in three blocks, merged by log-sum-exp
    rows, cuts = slice(8, 12), [(0, 5), (5, 8), (8, 12)]
    out = lse = None
    for lo, hi in cuts:
        diagonal = causal and hi == 12
        part = blocks.forward_with_lse(
            q[..., rows, :], k[..., lo:hi, :], v[..., lo:hi, :], scale, diagonal, fused
        )
        if out is None:
            out, lse = part
        else:
            blocks.merge_into(out, lse, *part)
    torch.testing.assert_close(out, expected[..., rows, :], **TOL)
    torch.testing.assert_close(blocks.attend(q, k, v, scale, causal), expected, **TOL)
    # the backward of one whole-key block from the final lse is autograd's
    full_out, full_lse = blocks.forward_with_lse(q, k, v, scale, causal, fused)
    dq, dk, dv = blocks.backward_from_lse(
        q, k, v, grad_out, full_out, full_lse, scale, causal, fused
    )
    for got, t in zip((dq, dk, dv), full, strict=True):
        torch.testing.assert_close(got, t.grad, **TOL)
    if fused:  # the kernel's causal mask sits at the top-left corner: only squares
        with pytest.raises(ValueError, match="fused causal block must be square"):
            blocks.forward_with_lse(q[..., rows, :], k, v, scale, True, fused)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialized"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_in_tiles_equals_full_attention_and_keeps_no_probabilities(causal, fused):
    """Queries cut into segments that each see the keys up to their own end (the
    all-gather's two chunks), in tiles of 3 rows and keys: the output and dQ/dK/dV of the
    segments' full attention, and for backward it keeps q, the keys and values, the
    output and the log-sum-exp alone."""
    heads, kv_heads, s = 4, 2, 16
    q = _randn(B, heads, 8, D, seed=1).requires_grad_()
    kv = _randn(2, B, kv_heads, s, D, seed=2).requires_grad_()
    grad_out = _randn(B, heads, 8, D, seed=3)
    ends = (6, 16)  # segment 0 sees keys 0..5, segment 1 all 16, causal at its corner
    out = blocks.attend_in_tiles(q, kv, 0.3, causal, 3, ends, fused)
    saved = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in out.grad_fn.saved_tensors}  # fmt: skip
    lse = B * heads * 8 * 8  # float64
    assert sum(saved.values()) == q.nbytes + kv.nbytes + out.nbytes + lse
    out.backward(grad_out)
    got = (out.detach(), q.grad, kv.grad)
    q.grad = kv.grad = None
    expected = torch.cat(
        [blocks.attend(q[:, :, 4 * m : 4 * m + 4], kv[0, :, :, :end], kv[1, :, :, :end], 0.3,
                       causal) for m, end in enumerate(ends)],
        dim=2,
    )  # fmt: skip
    expected.backward(grad_out)
    for a, b in zip(got, (expected.detach(), q.grad, kv.grad), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="cannot be cut into 3 equal segments"):
        blocks.attend_in_tiles(q, kv, 0.3, causal, 3, (8, 8, 8))
    with pytest.raises(ValueError, match="block must be >= 1"):
        blocks.attend_in_tiles(q, kv, 0.3, causal, 0)


def test_kv_repeats_make_kv_heads_divisible():
    for kv_heads, cp in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 4, 8)):
        f = kv_repeats(kv_heads, cp)
        assert (kv_heads * f) % cp == 0
        assert all((kv_heads * g) % cp for g in range(1, f))  # the fewest repeats


# ----- on gloo ranks ---------------------------------------------------------------


class _CPGroups:
    """This rank's cp group of a grid with ``cp`` context-parallel ranks (destroyed on exit)."""

    def __init__(self, cp: int):
        self.grid = ProcessGrid(dist.get_world_size(), context_parallel_size=cp)
        self.mine = []

    def __enter__(self):
        rank = dist.get_rank()
        group = None
        for members in self.grid.groups("cp"):
            made = comm.new_group(members, "context-parallel")
            if rank in members:
                group = made
                self.mine.append(made)
        return group

    def __exit__(self, *exc):
        for group in self.mine:
            dist.destroy_process_group(group)


def _check_against_reference(group, comm_type, causal, heads, kv_heads, s, seed):
    cp, me = comm.world_size(group), comm.rank(group)
    q, k, v = (_randn(B, h, s, D, seed=seed + i) for i, h in enumerate((heads, kv_heads, kv_heads)))
    grad_out = _randn(B, heads, s, D, seed=seed + 3)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full, causal)
    expected.backward(grad_out)

    mine = [layout.split(t, cp, me, dim=2).requires_grad_() for t in (q, k, v)]
    out = attention(*mine, group=group, comm_type=comm_type, causal=causal)
    out.backward(layout.split(grad_out, cp, me, dim=2))
    case = (comm_type, causal, heads, kv_heads, cp)
    torch.testing.assert_close(out, layout.split(expected, cp, me, dim=2), **TOL, msg=str(case))
    for name, local, reference in zip("qkv", mine, full, strict=True):
        torch.testing.assert_close(
            local.grad,
            layout.split(reference.grad, cp, me, dim=2),
            **TOL,
            msg=f"d{name} {case}",
        )
    # the slices gathered back are the whole output
    torch.testing.assert_close(layout.gather(out, group, dim=2), expected, **TOL)


@pytest.mark.parametrize("comm_type", list(COMM_TYPES))
@pytest.mark.parametrize("world_size, cp", [(2, 2), (4, 4), (4, 2)])
@distributed()
def test_attention_equals_full_attention(world_size, cp, comm_type):
    s = 4 * cp  # two chunks of two tokens per rank
    with _CPGroups(cp) as group:
        for seed, (causal, (heads, kv_heads)) in enumerate(itertools.product((True, False), HEADS)):
            _check_against_reference(group, comm_type, causal, heads, kv_heads, s, 10 * seed)


@distributed(world_size=4)
def test_longer_sequence_and_custom_scale():
    # unequal head size and more tokens per chunk; an explicit softmax scale
    with _CPGroups(4) as group:
        me = comm.rank(group)
        s, heads, kv_heads = 24, 8, 2
        q, k, v = (_randn(1, h, s, 4, seed=i) for i, h in enumerate((heads, kv_heads, kv_heads)))
        repeat = heads // kv_heads
        for comm_type in COMM_TYPES:
            out = attention(
                *(layout.split(t, 4, me, dim=2) for t in (q, k, v)),
                group=group,
                comm_type=comm_type,
                softmax_scale=0.3,
            )
            expected = torch.nn.functional.scaled_dot_product_attention(
                q,
                k.repeat_interleave(repeat, dim=1),
                v.repeat_interleave(repeat, dim=1),
                is_causal=True,
                scale=0.3,
            )
            torch.testing.assert_close(out, layout.split(expected, 4, me, dim=2), **TOL)


@distributed(world_size=2)
def test_bad_input_raises_one_clear_line():
    with _CPGroups(2) as group:
        ok = _randn(1, 4, 4, D, seed=0)
        cases = [
            (
                dict(q=_randn(1, 4, 3, D, seed=0), k=_randn(1, 4, 3, D, seed=1)),
                "p2p",
                r"sequence length 6 is not divisible by 2 × context-parallel size \(2 × 2 = 4\)",
            ),
            (dict(q=ok, k=ok), "ring", r"unknown comm_type 'ring'; choose one of 'p2p', "),
            (
                dict(q=_randn(1, 3, 4, D, seed=0), k=_randn(1, 3, 4, D, seed=1)),
                "a2a",
                r"but 3 query heads are not divisible by cp = 2",
            ),
            (
                dict(q=_randn(1, 6, 4, D, seed=0), k=_randn(1, 4, 4, D, seed=1)),
                "p2p",
                r"6 query heads are not divisible by 4 key/value heads",
            ),
            (
                dict(q=ok, k=_randn(1, 4, 2, D, seed=1)),
                "all_gather",
                r"must match q \(1, 4, 4, 8\) in batch, sequence",
            ),
        ]
        for tensors, comm_type, message in cases:
            k = tensors["k"]
            with pytest.raises(ValueError, match=message) as info:
                attention(tensors["q"], k, k.clone(), group=group, comm_type=comm_type)
            assert "\n" not in str(info.value)
        # the same three heads are fine for the ring and the all-gather
        q3 = layout.split(_randn(1, 3, 8, D, seed=0), 2, comm.rank(group), dim=2)
        for comm_type in ("p2p", "all_gather"):
            assert attention(q3, q3, q3, group=group, comm_type=comm_type).shape == q3.shape


def test_one_rank_is_plain_attention():
    q, k, v = _randn(B, 4, 6, D, seed=0), _randn(B, 2, 6, D, seed=1), _randn(B, 2, 6, D, seed=2)
    for comm_type in COMM_TYPES:
        out = attention(q, k, v, group=None, comm_type=comm_type)
        torch.testing.assert_close(out, _reference(q, k, v, True), **TOL)
    with pytest.raises(ValueError, match="unknown comm_type 'p2p '"):
        attention(q, k, v, group=None, comm_type="p2p ")
