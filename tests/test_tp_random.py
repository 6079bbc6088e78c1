"""RNG streams across tensor-parallel ranks, fork semantics, and checkpointing that replays them.

Random draws are compared bit for bit: the same generator state gives the same numbers, so the
single-process expression is a fresh ``torch.Generator`` seeded by the documented formula.
"""

import gc
import io
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapp import parallel_state as ps
from megapp.tensor_parallel import (
    DATA_PARALLEL_RNG_TRACKER_NAME,
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_manual_seed,
)
from megapp.testing import distributed

SEED = 1234


@pytest.fixture(autouse=True)
def _leave_rng_as_found():
    """Tests here reseed the process-wide generators and tracker; put them back afterwards."""
    tracker = get_rng_tracker()
    states = tracker.get_states()
    with torch.random.fork_rng(devices=[]):
        yield
    tracker.reset()
    tracker.set_states(states)


def _draws(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def _all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts


# ---------------------------------------------------------------------------------------------
# Streams across ranks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, tp, pp", [(2, 2, 1), (4, 2, 1), (4, 2, 2), (4, 4, 1)])
@distributed()
def test_default_stream_shared_and_model_parallel_stream_per_tp_rank(world_size, tp, pp):
    grid = ps.initialize_model_parallel(tp, pp)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    seeds = model_parallel_manual_seed(SEED)  # ranks read from parallel_state
    default_seed = SEED + 100 * pp_rank
    assert seeds == {
        "default": default_seed,
        DATA_PARALLEL_RNG_TRACKER_NAME: default_seed,
        MODEL_PARALLEL_RNG_TRACKER_NAME: default_seed + 2718 + tp_rank,
    }
    before = torch.rand(8)
    with get_rng_tracker().fork():  # model-parallel-rng by default
        model_parallel = torch.rand(8)
    after = torch.rand(8)
    with get_rng_tracker().fork(DATA_PARALLEL_RNG_TRACKER_NAME):
        data_parallel = torch.rand(8)
    # Exact: the single-process generator seeded by the documented formula.
    assert torch.equal(torch.cat([before, after]), _draws(default_seed, 16))
    assert torch.equal(model_parallel, _draws(default_seed + 2718 + tp_rank, 8))
    assert torch.equal(data_parallel, _draws(default_seed, 8))

    defaults, model_parallels = _all_gather(before), _all_gather(model_parallel)
    for rank in range(world_size):
        coords = grid.coords(rank)
        same_stage = coords["pp"] == pp_rank
        assert torch.equal(defaults[rank], before) == same_stage, (rank, coords)
        same_tp_rank = same_stage and coords["tp"] == tp_rank
        assert torch.equal(model_parallels[rank], model_parallel) == same_tp_rank, (rank, coords)


@distributed(world_size=2)
def test_dropout_masks_inside_and_outside_tp_regions():
    ps.initialize_model_parallel(2)
    model_parallel_manual_seed(SEED)
    ones = torch.ones(64)
    replicated = F.dropout(ones, 0.5)
    with get_rng_tracker().fork():
        split = F.dropout(ones, 0.5)
    other_replicated, other_split = (
        _all_gather(t)[1 - dist.get_rank()] for t in (replicated, split)
    )
    assert torch.equal(replicated, other_replicated)  # replicated activations: one mask
    assert not torch.equal(split, other_split)  # a TP region: each rank its own mask


def test_manual_seed_without_torch_distributed():
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    assert model_parallel_manual_seed(5)[MODEL_PARALLEL_RNG_TRACKER_NAME] == 5 + 2718
    seeds = model_parallel_manual_seed(5, tp_rank=3, pp_rank=2)
    assert seeds == {"default": 205, "data-parallel-rng": 205, "model-parallel-rng": 205 + 2718 + 3}
    assert torch.equal(torch.rand(4), _draws(205, 4))
    assert sorted(get_rng_tracker().names) == ["data-parallel-rng", "model-parallel-rng"]


# ---------------------------------------------------------------------------------------------
# Fork semantics
# ---------------------------------------------------------------------------------------------


def _tracker(**seeds: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker()
    for name, seed in seeds.items():
        tracker.add(name, seed)
    return tracker


def test_fork_restores_the_outer_state_and_streams_continue():
    tracker = _tracker(a=11)
    torch.manual_seed(0)
    first = torch.rand(4)
    with tracker.fork("a"):
        a1 = torch.rand(3)
        torch.randn(100)  # whatever the body draws stays in the stream
    middle = torch.rand(4)
    with tracker.fork("a"):
        a2 = torch.rand(3)
    last = torch.rand(4)
    # The default generator never saw the forks; the stream picks up where it stopped.
    assert torch.equal(torch.cat([first, middle, last]), _draws(0, 12))
    gen = torch.Generator().manual_seed(11)
    expected_a1 = torch.rand(3, generator=gen)
    torch.randn(100, generator=gen)
    assert torch.equal(a1, expected_a1)
    assert torch.equal(a2, torch.rand(3, generator=gen))


def test_fork_restores_even_when_the_body_raises():
    tracker = _tracker(a=11)
    torch.manual_seed(0)
    with pytest.raises(KeyError), tracker.fork("a"):
        torch.rand(5)
        raise KeyError("boom")
    assert torch.equal(torch.rand(4), _draws(0, 4))
    with tracker.fork("a"):
        assert torch.equal(torch.rand(2), _draws(11, 7)[5:])


def test_nested_forks():
    tracker = _tracker(a=11, b=22)
    torch.manual_seed(0)
    with tracker.fork("a"):
        a1 = torch.rand(2)
        with tracker.fork("b"):
            b1 = torch.rand(2)
        a2 = torch.rand(2)
        with tracker.fork("a"):  # already current: it just continues
            a3 = torch.rand(2)
        with tracker.fork("b"):
            b2 = torch.rand(2)
            with (
                pytest.raises(RuntimeError, match="'a' is forked by an outer context"),
                tracker.fork("a"),
            ):
                pass
    assert torch.equal(torch.cat([a1, a2, a3]), _draws(11, 6))
    assert torch.equal(torch.cat([b1, b2]), _draws(22, 4))
    assert torch.equal(torch.rand(3), _draws(0, 3))


def test_states_round_trip():
    tracker = _tracker(a=11, b=22)
    with tracker.fork("a"):
        torch.rand(3)
    saved = tracker.get_states()
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # as a training checkpoint would store them
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    def draw_both():
        with tracker.fork("a"):
            a = torch.rand(5)
        with tracker.fork("b"):
            b = torch.rand(5)
        return a, b

    first = draw_both()
    tracker.set_states(saved)
    again = draw_both()
    tracker.reset()
    tracker.set_states(loaded)
    third = draw_both()
    for one, two, three in zip(first, again, third, strict=True):
        assert torch.equal(one, two) and torch.equal(one, three)
    assert torch.equal(first[0], _draws(11, 8)[3:])


def test_tracker_misuse():
    tracker = _tracker(a=11)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 12)
    with pytest.raises(ValueError, match="seed 11 is already used"):
        tracker.add("b", 11)
    with pytest.raises(ValueError, match="'c' was never added"), tracker.fork("c"):
        pass
    with pytest.raises(ValueError, match="expected a"):
        tracker.set_states({"a": torch.get_rng_state()})  # a bare tensor, not a mapping
    tracker.reset()
    assert not tracker.is_initialized()
    tracker.add("a", 11)  # names and seeds are free again


# ---------------------------------------------------------------------------------------------
# Checkpointing
# ---------------------------------------------------------------------------------------------

CALLS = []  # one entry per run of _block: forward, then the recomputation


def _block(x, w1, w2, p: float, scale: float, *, tag: str = "block"):
    """Two matmuls with dropout on the default stream and on the model-parallel stream."""
    CALLS.append(tag)
    h = F.dropout(x @ w1, p)  # replicated activations: default generator
    with get_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p)  # a TP region: this rank's stream
    out = (h @ w2) * scale
    return out, h.sum(dim=-1), tag  # several outputs, one of them not a tensor


def _run(use_checkpoint: bool, x_requires_grad: bool = True, device: str = "cpu"):
    """Loss, gradients and the RNG states left after backward, from the same seeds."""
    model_parallel_manual_seed(SEED, tp_rank=dist.get_rank() if dist.is_initialized() else 0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen).to(device).requires_grad_(x_requires_grad)
    w1 = torch.randn(8, 16, generator=gen).to(device).requires_grad_()
    w2 = torch.randn(16, 4, generator=gen).to(device).requires_grad_()
    args = (x, w1, w2, 0.3, 2.0)
    if use_checkpoint:
        out, aux, tag = checkpoint(_block, *args, tag="ckpt")
    else:
        out, aux, tag = _block(*args, tag="plain")
    loss = out.square().sum() + aux.sum()
    between = torch.rand(3)  # both streams move on between forward and backward
    with get_rng_tracker().fork():
        between = between + torch.rand(3)
    loss.backward()
    grads = [t.grad for t in (x, w1, w2)]
    after = (torch.get_rng_state(), get_rng_tracker().get_states(), torch.rand(4))
    return loss.detach(), grads, after, tag


def _assert_checkpoint_is_bit_identical(x_requires_grad: bool = True, device: str = "cpu"):
    CALLS.clear()
    loss, grads, after, _ = _run(False, x_requires_grad, device)
    ckpt_loss, ckpt_grads, ckpt_after, tag = _run(True, x_requires_grad, device)
    assert tag == "ckpt" and CALLS == ["plain", "ckpt", "ckpt"]  # recomputed once, in backward
    assert torch.equal(loss, ckpt_loss)  # bitwise: same masks, same arithmetic
    assert (grads[0] is None) == (ckpt_grads[0] is None) == (not x_requires_grad)
    for grad, ckpt_grad in zip(grads, ckpt_grads, strict=True):
        assert (grad is None and ckpt_grad is None) or torch.equal(grad, ckpt_grad)
    # The recomputation consumed no randomness: every generator and stream is where it was.
    assert torch.equal(after[0], ckpt_after[0]) and torch.equal(after[2], ckpt_after[2])
    for name, state in after[1].items():
        assert all(torch.equal(v, ckpt_after[1][name][k]) for k, v in state.items()), name


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_checkpoint_with_dropout_is_bit_identical(x_requires_grad):
    _assert_checkpoint_is_bit_identical(x_requires_grad)


@distributed(world_size=2)
def test_checkpoint_with_dropout_is_bit_identical_on_tp_ranks():
    ps.initialize_model_parallel(2)
    _assert_checkpoint_is_bit_identical()
    # ... while the model-parallel stream gave each rank its own masks.
    loss = _run(True)[0]
    assert not torch.equal(*_all_gather(loss.reshape(1)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_with_dropout_is_bit_identical_on_cuda():
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        _assert_checkpoint_is_bit_identical(device="cuda")


def test_checkpoint_inside_a_fork_of_the_same_stream():
    # The block forks the stream that is already current; the recomputation must see it so too.
    def run(use_checkpoint):
        model_parallel_manual_seed(SEED)
        w = torch.randn(8, 8).requires_grad_()
        with get_rng_tracker().fork():
            fn = (lambda w: checkpoint(_block, w, w, w, 0.5, 1.0)) if use_checkpoint else None
            out = fn(w)[0] if fn else _block(w, w, w, 0.5, 1.0)[0]
        out.sum().backward()
        return w.grad

    assert torch.equal(run(False), run(True))


def test_checkpoint_keeps_no_activations():
    seen = []

    def block(x, w):
        h = x @ w  # mul saves h for backward: without checkpointing it stays alive
        seen.append(weakref.ref(h))
        return h * h

    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    plain = block(x, w)
    ckpt = checkpoint(block, x, w)
    gc.collect()
    assert seen[0]() is not None and seen[1]() is None
    (ckpt.sum() + plain.sum()).backward()
    torch.testing.assert_close(w.grad, 2 * (x.T @ (2 * (x @ w))), rtol=1e-6, atol=1e-5)


def test_checkpoint_supports_autograd_grad_and_no_grad():
    x = torch.randn(3, 5, requires_grad=True)
    y = checkpoint(lambda t: (t.sin() * t).sum(), x)
    (grad,) = torch.autograd.grad(y, x)
    assert torch.equal(grad, torch.autograd.grad((x.sin() * x).sum(), x)[0])
    with torch.no_grad():
        assert not checkpoint(torch.sin, x).requires_grad


def test_checkpoint_rejects_a_function_that_changes_between_runs():
    state = {"calls": 0}

    def flaky(x):
        state["calls"] += 1
        return x.exp() if state["calls"] == 1 else x.exp().exp()

    y = checkpoint(flaky, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"recomputation saved 2 tensors .* forward saved 1"):
        y.sum().backward()
