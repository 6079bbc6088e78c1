"""Fused bias + dropout + residual add: Philox mask, CPU (and CUDA) kernels, autograd, RNG."""

from __future__ import annotations

import os

import pytest
import torch

from megapp.fusions.bias_ops import (
    BiasDropoutAddFunction,
    bias_dropout_add,
    bias_dropout_add_reference,
    bias_dropout_add_reference_backward,
    draw_dropout_seed,
    dropout_mask,
    philox4x32_10,
)
from megapp.fusions.extension import cuda_ops_available, select_tier
from megapp.tensor_parallel.random import RNGStatesTracker, checkpoint
from tests import support
from tests.support import requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

SHAPES = [(1, 8), (4, 7), (3, 5, 13), (2, 3, 4, 1), (257, 300), (16, 2, 1000)]
SEED = 0x1234_5678_9ABC_DEF  # exercises both 32-bit halves of the key
FP64_TOL = {"rtol": 1e-12, "atol": 1e-12}
# Kernels and reference run the same operations in the same order and round once, so forward
# values and grad_x agree bit for bit in every dtype; only grad_bias's summation order differs.
EXACT = {"rtol": 0.0, "atol": 0.0}


@pytest.fixture(params=["reference", "fused"])
def tier(request, monkeypatch):
    """Runs a test through the reference and through the compiled CPU kernels."""
    if request.param == "reference":
        monkeypatch.setenv("MEGAPP_FUSED", "0")
    elif os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")
    return request.param


def _inputs(shape, dtype, device="cpu", seed=0):
    """x, bias [h], residual, grad; x + bias is never exactly 0, so kept outputs differ from
    the residual."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    bias = torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    residual = torch.randn(shape, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, bias, residual, grad))


def _grad_bias_tol(dtype, rows):
    # grad_bias sums `rows` terms in another order than torch.sum: ~rows·eps·|terms| apart, plus
    # one output rounding for low precision.
    eps = {torch.float64: 1e-15, torch.float32: 1e-6}.get(dtype, 2**-7)
    return {"rtol": eps, "atol": 10 * eps * max(1, rows)}


# --- Philox and the mask --------------------------------------------------------------------


def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32 with 10 rounds.
    counters = torch.tensor(
        [
            [0, 0, 0, 0],
            [0xFFFFFFFF] * 4,
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        ],
        dtype=torch.int64,
    )
    keys = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0)]
    expected = [
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ]
    for counter, key, want in zip(counters, keys, expected, strict=True):
        assert philox4x32_10(counter, key).tolist() == want


@pytest.mark.parametrize(
    "p", [pytest.param(0.1, marks=pytest.mark.slow), 0.5, pytest.param(0.9, marks=pytest.mark.slow)]
)
def test_keep_rate(p):
    mask = dropout_mask((400, 500), p, SEED).float()

    def bound(n):  # 6 standard errors of the mean of n Bernoulli(1 − p) draws
        return 6 * (p * (1 - p) / n) ** 0.5

    assert abs(mask.mean().item() - (1 - p)) < bound(mask.numel())
    # No structure: every row, every column and each of the 4 lanes of a Philox block keep
    # about 1 − p, and neighbouring elements are uncorrelated.
    assert (mask.mean(dim=1) - (1 - p)).abs().max() < bound(500)
    assert (mask.mean(dim=0) - (1 - p)).abs().max() < bound(400)
    lanes = mask.reshape(-1, 4).mean(dim=0)
    assert (lanes - (1 - p)).abs().max() < bound(mask.numel() // 4)
    flat = mask.reshape(-1) - mask.mean()
    correlation = (flat[1:] * flat[:-1]).mean() / flat.pow(2).mean()
    assert abs(correlation.item()) < 6 / mask.numel() ** 0.5


def test_mask_edge_probabilities_and_seeds():
    assert dropout_mask((9, 7), 0.0, SEED).all()
    assert not dropout_mask((9, 7), 1.0, SEED).any()
    a, b = dropout_mask((64, 64), 0.5, 1), dropout_mask((64, 64), 0.5, 2)
    assert torch.equal(a, dropout_mask((64, 64), 0.5, 1))  # a pure function of the seed
    assert not torch.equal(a, b)
    # Seeds differing only in the high 32 bits of the key differ too.
    assert not torch.equal(a, dropout_mask((64, 64), 0.5, 1 + (1 << 32)))
    assert dropout_mask((0, 5), 0.5, 1).shape == (0, 5)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 37])
def test_mask_offset_partitions_a_tensor(offset):
    # The mask of a tensor's tail, drawn with the tail's first flat index as offset, is the
    # whole mask's tail: callers may split a tensor and still draw the same mask.
    whole = dropout_mask((10, 13), 0.3, SEED).reshape(-1)
    tail = dropout_mask((130 - offset,), 0.3, SEED, offset)
    assert torch.equal(whole[offset:], tail)


def test_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"probability must be in \[0, 1\]"):
        dropout_mask((4,), 1.5, 0)
    with pytest.raises(ValueError, match="offset"):
        dropout_mask((4,), 0.5, 0, -1)
    with pytest.raises(ValueError, match="seed must fit in int64"):
        dropout_mask((4,), 0.5, 2**64)


# --- CPU kernels against the reference --------------------------------------------------------


@requires_cpu_ext
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 6, 1001])
# (3, 600): rows longer than the kernel's 256-element chunks, chunk starts off block boundaries.
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 13), (33, 64), (3, 600)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_cpu_kernel_mask_is_the_reference_mask(ops, shape, p, offset):
    expected = dropout_mask(shape, p, SEED, offset)
    ones, zeros = torch.ones(shape), torch.zeros(shape)
    # Forward with x = 1, residual = 0 writes 1/(1 − p) where kept and 0 where dropped.
    out = ops.bias_dropout_add_fwd(ones, None, zeros, p, SEED, offset)
    assert torch.equal(out != 0, expected)
    # Backward with grad = 1 regenerates the same mask.
    grad_x, _ = ops.bias_dropout_add_bwd(ones, p, SEED, offset, False)
    assert torch.equal(grad_x != 0, expected)


@requires_cpu_ext
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_cpu_kernel_matches_reference(ops, shape, dtype, p):
    x, bias, residual, grad = _inputs(shape, dtype)
    out = ops.bias_dropout_add_fwd(x, bias, residual, p, SEED, 5)
    assert out.dtype == dtype
    ref = bias_dropout_add_reference(x, bias, residual, p, SEED, 5)
    torch.testing.assert_close(out, ref, **EXACT)
    no_bias = ops.bias_dropout_add_fwd(x, None, residual, p, SEED, 5)
    torch.testing.assert_close(
        no_bias, bias_dropout_add_reference(x, None, residual, p, SEED, 5), **EXACT
    )
    grad_x, grad_bias = ops.bias_dropout_add_bwd(grad, p, SEED, 5, True)
    ref_x, ref_bias = bias_dropout_add_reference_backward(grad, p, SEED, 5)
    torch.testing.assert_close(grad_x, ref_x, **EXACT)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(grad_bias, ref_bias, **_grad_bias_tol(dtype, rows))
    assert ops.bias_dropout_add_bwd(grad, p, SEED, 5, False)[1] is None


@requires_cpu_ext
def test_cpu_kernel_low_precision_rounds_once(ops):
    # bf16 inputs, float math, one rounding: the same as the float32 kernel's result rounded.
    x, bias, residual, _ = _inputs((64, 96), torch.bfloat16)
    out = ops.bias_dropout_add_fwd(x, bias, residual, 0.2, SEED, 0)
    out32 = ops.bias_dropout_add_fwd(x.float(), bias.float(), residual.float(), 0.2, SEED, 0)
    assert torch.equal(out, out32.bfloat16())


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    x, bias, residual, grad = _inputs((8, 12), torch.float32)
    xt, rt, gt, bias8 = x.t(), residual.t(), grad.t(), bias[:8]  # [12, 8], non-contiguous
    torch.testing.assert_close(
        ops.bias_dropout_add_fwd(xt, bias8, rt, 0.4, SEED, 0),
        bias_dropout_add_reference(xt.contiguous(), bias8, rt.contiguous(), 0.4, SEED, 0),
        **EXACT,
    )
    grad_x, grad_bias = ops.bias_dropout_add_bwd(gt, 0.4, SEED, 0, True)
    ref_x, ref_bias = bias_dropout_add_reference_backward(gt.contiguous(), 0.4, SEED, 0)
    torch.testing.assert_close(grad_x, ref_x, **EXACT)
    torch.testing.assert_close(grad_bias, ref_bias, **_grad_bias_tol(torch.float32, 12))
    bias_strided = torch.randn(24)[::2]
    torch.testing.assert_close(
        ops.bias_dropout_add_fwd(x, bias_strided, residual, 0.4, SEED, 0),
        bias_dropout_add_reference(x, bias_strided, residual, 0.4, SEED, 0),
        **EXACT,
    )
    empty = torch.empty(0, 12)
    assert ops.bias_dropout_add_fwd(empty, bias, empty, 0.5, SEED, 0).shape == (0, 12)
    grad_x, grad_bias = ops.bias_dropout_add_bwd(empty, 0.5, SEED, 0, True)
    assert grad_x.shape == (0, 12)
    assert torch.equal(grad_bias, torch.zeros(12))


@requires_cpu_ext
def test_cpu_kernel_is_deterministic_across_threads(ops):
    # Row blocks depend on the shape only, so the thread count cannot change the bits.
    x, bias, residual, grad = _inputs((1024, 96), torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = ops.bias_dropout_add_fwd(x, bias, residual, 0.3, SEED, 0)
            results.append((out, *ops.bias_dropout_add_bwd(grad, 0.3, SEED, 0, True)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"last dim of x \(8\) must equal the bias size \(7\)"):
        ops.bias_dropout_add_fwd(x, torch.randn(7), x, 0.1, 0, 0)
    with pytest.raises(RuntimeError, match="bias must be 1-D"):
        ops.bias_dropout_add_fwd(x, torch.randn(1, 8), x, 0.1, 0, 0)
    with pytest.raises(RuntimeError, match=r"residual shape \[4, 9\] must equal x shape \[4, 8\]"):
        ops.bias_dropout_add_fwd(x, None, torch.randn(4, 9), 0.1, 0, 0)
    with pytest.raises(RuntimeError, match="x and residual must have the same dtype"):
        ops.bias_dropout_add_fwd(x, None, x.double(), 0.1, 0, 0)
    with pytest.raises(RuntimeError, match="x and bias must have the same dtype"):
        ops.bias_dropout_add_fwd(x, torch.randn(8, dtype=torch.float64), x, 0.1, 0, 0)
    with pytest.raises(RuntimeError, match=r"probability must be in \[0, 1\], got 1.5"):
        ops.bias_dropout_add_fwd(x, None, x, 1.5, 0, 0)
    with pytest.raises(RuntimeError, match="offset must be non-negative"):
        ops.bias_dropout_add_bwd(x, 0.1, 0, -3, True)


def test_public_function_rejects_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"bias must be \[h\] and x \[\.\.\., h\]"):
        bias_dropout_add(x, torch.randn(7), x, 0.1, True)
    with pytest.raises(ValueError, match="residual shape"):
        bias_dropout_add(x, None, torch.randn(4, 9), 0.1, True)
    with pytest.raises(ValueError, match="dtypes differ"):
        bias_dropout_add(x, None, x.bfloat16(), 0.1, True)
    with pytest.raises(ValueError, match=r"probability must be in \[0, 1\]"):
        bias_dropout_add(x, None, x, -0.1, True)


# --- autograd, seeds and generator state ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_backward_regenerates_the_forward_mask(tier, dtype):
    x, bias, _, grad = _inputs((37, 24), dtype)
    # A zero residual leaves the dropped elements exactly 0 (x + bias never is).
    residual = torch.zeros_like(x)
    for t in (x, bias, residual):
        t.requires_grad_(True)
    p = 0.4
    state = torch.get_rng_state()
    out = bias_dropout_add(x, bias, residual, p, True)
    out.backward(grad)
    # The forward's mask, read off its output...
    forward_mask = out.detach() != 0
    # ...is the one backward applied: grad_x = mask · grad / (1 − p), exactly.
    scale = torch.tensor(1 / (1 - p), dtype=torch.promote_types(dtype, torch.float32))
    expected = torch.where(forward_mask, grad.to(scale.dtype) * scale, 0.0).to(dtype)
    assert torch.equal(x.grad, expected)
    # ...and is dropout_mask of the seed drawn from the generator state the forward found.
    torch.set_rng_state(state)
    assert torch.equal(forward_mask, dropout_mask(x.shape, p, draw_dropout_seed()))
    assert torch.equal(residual.grad, grad)
    torch.testing.assert_close(bias.grad, x.grad.sum(0), **_grad_bias_tol(dtype, 37))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_autograd_matches_reference(tier, dtype):
    x, bias, residual, grad = _inputs((3, 5, 40), dtype)
    for t in (x, bias, residual):
        t.requires_grad_(True)
    state = torch.get_rng_state()
    out = bias_dropout_add(x, bias, residual, 0.25, True)
    out.backward(grad)
    torch.set_rng_state(state)
    seed = draw_dropout_seed()
    detached = (t.detach() for t in (x, bias, residual))
    torch.testing.assert_close(out, bias_dropout_add_reference(*detached, 0.25, seed), **EXACT)
    ref_x, ref_bias = bias_dropout_add_reference_backward(grad, 0.25, seed)
    torch.testing.assert_close(x.grad, ref_x, **EXACT)
    torch.testing.assert_close(bias.grad, ref_bias, **_grad_bias_tol(dtype, 15))
    assert torch.equal(residual.grad, grad)


def test_same_generator_state_same_output(tier):
    x, bias, residual, _ = _inputs((16, 32), torch.float32)
    torch.manual_seed(7)
    first = bias_dropout_add(x, bias, residual, 0.5, True)
    second = bias_dropout_add(x, bias, residual, 0.5, True)  # the generator has moved on
    torch.manual_seed(7)
    again = bias_dropout_add(x, bias, residual, 0.5, True)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_tracker_fork_changes_the_mask(tier):
    x, bias, residual, _ = _inputs((16, 32), torch.float32)
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 2718)
    torch.manual_seed(7)
    plain = bias_dropout_add(x, bias, residual, 0.5, True)
    torch.manual_seed(7)
    with tracker.fork("model-parallel-rng"):
        forked = bias_dropout_add(x, bias, residual, 0.5, True)
    assert not torch.equal(plain, forked)
    # The fork drew from its own stream: the default generator is where the seed left it.
    assert torch.equal(bias_dropout_add(x, bias, residual, 0.5, True), plain)


def test_checkpoint_recompute_reproduces_the_mask(tier):
    x, bias, residual, grad = _inputs((12, 20), torch.float32)
    weight = torch.randn(20, 20)

    def block(inp, w, b, r):
        return bias_dropout_add(inp @ w, b, r, 0.5, True).tanh()

    grads = []
    for use_checkpoint in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias, residual)]
        torch.manual_seed(3)
        out = checkpoint(block, *leaves) if use_checkpoint else block(*leaves)
        out.backward(grad)
        grads.append([t.grad for t in leaves])
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed)


def test_function_saves_no_tensor(tier):
    x, bias, residual, grad = _inputs((6, 10), torch.float32)
    for t in (x, bias, residual):
        t.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = bias_dropout_add(x, bias, residual, 0.5, True)
    assert saved == []  # neither x nor a mask: (seed, offset) regenerate it
    out.backward(grad)
    assert x.grad is not None and bias.grad is not None and residual.grad is not None


@pytest.mark.parametrize(("p", "training"), [(0.5, False), (0.0, True)])
def test_inference_path_adds_without_randomness(tier, p, training):
    x, bias, residual, grad = _inputs((9, 11), torch.float32)
    x.requires_grad_(True)
    state = torch.get_rng_state()
    out = bias_dropout_add(x, bias, residual, p, training)
    assert torch.equal(torch.get_rng_state(), state)  # no seed drawn
    # One rounding of residual + (x + bias), evaluated in float32 as well.
    torch.testing.assert_close(out, residual + (x.detach() + bias), **EXACT)
    out.backward(grad)
    assert torch.equal(x.grad, grad)
    assert torch.equal(bias_dropout_add(x, None, residual, p, training), residual + x)


def test_explicit_seed_and_offset_share_a_split_mask(tier):
    # Two halves of a tensor, drawn with one seed and their flat offsets, get the whole's mask.
    x, bias, residual, _ = _inputs((8, 16), torch.float32)
    whole = bias_dropout_add(x, bias, residual, 0.5, True, seed=SEED)
    top = bias_dropout_add(x[:3], bias, residual[:3], 0.5, True, seed=SEED)
    bottom = bias_dropout_add(x[3:], bias, residual[3:], 0.5, True, seed=SEED, offset=3 * 16)
    assert torch.equal(torch.cat([top, bottom]), whole)


def test_gradcheck_function(tier):
    x, bias, residual, _ = _inputs((3, 5, 7), torch.float64)
    expected_tier = "reference" if tier == "reference" else "cpu"
    if os.environ.get("MEGAPP_BUILD_CPU_EXT") == "0":
        expected_tier = "reference"
    assert select_tier("bias_dropout_add", x) == expected_tier
    inputs = tuple(t.requires_grad_(True) for t in (x, bias, residual))

    def fn(x, bias, residual):
        return BiasDropoutAddFunction.apply(x, bias, residual, 0.3, SEED, 2)

    assert torch.autograd.gradcheck(fn, inputs)


# --- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 13), (33, 64), (2048, 1024)])
@pytest.mark.parametrize("offset", [0, 3])
def test_cuda_kernel_matches_cpu_bit_for_bit(dtype, shape, offset):
    # Same Philox stream and the same float operations (no FMA contraction): the CUDA kernel
    # reproduces the CPU kernel's bits, mask and values, in every dtype.
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    ops = torch.ops.megapp
    x, bias, residual, grad = _inputs(shape, dtype)
    for b in (bias, None):
        cpu = ops.bias_dropout_add_fwd(x, b, residual, 0.3, SEED, offset)
        cuda_bias = None if b is None else b.cuda()
        gpu = ops.bias_dropout_add_fwd(x.cuda(), cuda_bias, residual.cuda(), 0.3, SEED, offset)
        assert torch.equal(gpu.cpu(), cpu)
    mask = dropout_mask(shape, 0.3, SEED, offset, device="cuda")
    grad_x, grad_bias = ops.bias_dropout_add_bwd(grad.cuda(), 0.3, SEED, offset, True)
    assert torch.equal(grad_x != 0, mask & (grad.cuda() != 0))
    ref_x, ref_bias = ops.bias_dropout_add_bwd(grad, 0.3, SEED, offset, True)
    assert torch.equal(grad_x.cpu(), ref_x)
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(grad_bias.cpu(), ref_bias, **_grad_bias_tol(dtype, rows))
    # Deterministic grad_bias: a second run gives the same bits.
    again = ops.bias_dropout_add_bwd(grad.cuda(), 0.3, SEED, offset, True)[1]
    assert torch.equal(grad_bias, again)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autograd_matches_cpu():
    x, bias, residual, grad = _inputs((64, 96), torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (x, bias, residual)]
        torch.manual_seed(11)  # the seed comes from the CPU generator on either device
        out = bias_dropout_add(*leaves, 0.1, True)
        out.backward(grad.to(device))
        results.append([out.detach().cpu(), leaves[0].grad.cpu()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
