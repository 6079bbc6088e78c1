"""Fused scaled masked softmax: CPU (and CUDA) kernels against the PyTorch reference."""

from __future__ import annotations

import os

import pytest
import torch

from megapp.fusions import choose_tier, cuda_ops_available, select_tier
from megapp.fusions.softmax import (
    ScaledMaskedSoftmaxFunction,
    causal_mask,
    scaled_masked_softmax,
    scaled_masked_softmax_reference,
    scaled_masked_softmax_reference_backward,
)
from tests import support
from tests.support import requires_cpu_ext

# Shared fixtures (pytest finds them as module attributes).
ops = support.ops
fused_unset = support.fused_unset

# (shape [b, heads, sq, sk], mask shape or None, causal). Odd row lengths, sq < sk, a single key,
# a row longer than the usual tile, and the mask broadcasts the kernels index by stride.
CASES = [
    ((2, 3, 5, 7), None, False),
    ((2, 3, 5, 7), None, True),
    ((2, 2, 6, 6), (2, 1, 6, 6), False),
    ((2, 2, 6, 6), (2, 1, 6, 6), True),
    ((3, 2, 4, 9), (1, 1, 4, 9), True),  # sq < sk: queries are the last 4 of 9 positions
    ((2, 4, 3, 33), (2, 1, 1, 33), False),  # key padding, broadcast over queries
    ((1, 2, 8, 8), (8, 8), True),
    ((1, 1, 1, 1), None, True),
    ((1, 2, 3, 1500), (1, 1, 3, 1500), False),
]

# fp32: kernel and reference run the same float ops per element (scale·x, exp(z − max), ·1/Σ);
# they differ in exp implementations (≈1 ulp) and in the order of the row sums (the kernel's 32
# partial sums, four 8-lane vector accumulators folded pairwise, vs torch's cascade), measured
# ≤ 5e-7 relative for rows up to 32768 in both instruction-set builds: rtol 4e-6.
FP32_TOL = {"rtol": 4e-6, "atol": 1e-7}
FP64_TOL = {"rtol": 1e-12, "atol": 1e-15}
# bf16/fp16 kernels compute in float and round once to the output type, so against the fp32
# reference on the same (already rounded) inputs the error is one rounding: at most the unit
# roundoff, 2^-8 (bf16) or 2^-11 (fp16), relative. rtol is twice that.
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 1e-6},
}


def _inputs(shape, mask_shape, dtype, device="cpu", seed=0, mask_p=0.3):
    gen = torch.Generator().manual_seed(seed)
    # Scale 4 makes rows peaked enough that the max subtraction matters.
    x = 4 * torch.randn(shape, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(mask_shape, generator=gen) < mask_p).to(device)
    return x.to(device=device, dtype=dtype), mask, grad.to(device=device, dtype=dtype)


def _naive(x, mask, scale, causal):
    """Textbook masked softmax in float64; fully masked rows set to zero afterwards."""
    z = x.double() * scale
    masked = torch.zeros(x.shape, dtype=torch.bool)
    if mask is not None:
        masked = masked | mask
    if causal:
        masked = masked | causal_mask(x.shape[-2], x.shape[-1])
    y = torch.softmax(z.masked_fill(masked, float("-inf")), dim=-1)
    return torch.nan_to_num(y, nan=0.0)


def test_causal_mask_generalizes_upper_triangle():
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).triu(1))
    # sq < sk: the last query sees every key, the first sees sk − sq + 1 of them.
    m = causal_mask(2, 5)
    assert m.tolist() == [[False] * 4 + [True], [False] * 5]


@pytest.mark.parametrize(("shape", "mask_shape", "causal"), CASES)
def test_reference_matches_naive_softmax(shape, mask_shape, causal):
    x, mask, _ = _inputs(shape, mask_shape, torch.float64)
    got = scaled_masked_softmax_reference(x, mask, 0.3, causal)
    torch.testing.assert_close(got, _naive(x, mask, 0.3, causal), **FP64_TOL)


def test_reference_fully_masked_row_is_zero_with_zero_grad():
    x, _, grad = _inputs((1, 2, 3, 5), None, torch.float64)
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    mask[..., 1, :] = True
    x.requires_grad_(True)
    y = scaled_masked_softmax_reference(x, mask, 1.0, causal=False)
    y.backward(grad)
    assert torch.equal(y[..., 1, :], torch.zeros(1, 2, 5, dtype=torch.float64))
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[..., 1, :], torch.zeros(1, 2, 5, dtype=torch.float64))
    torch.testing.assert_close(y[..., [0, 2], :].sum(-1), torch.ones(1, 2, 2, dtype=torch.float64))


def test_reference_backward_matches_autograd():
    x, mask, grad = _inputs((2, 3, 6, 6), (2, 1, 6, 6), torch.float64)
    x.requires_grad_(True)
    y = scaled_masked_softmax_reference(x, mask, 0.7, causal=True)
    y.backward(grad)
    got = scaled_masked_softmax_reference_backward(grad, y.detach(), 0.7)
    torch.testing.assert_close(got, x.grad, **FP64_TOL)


@requires_cpu_ext
@pytest.mark.parametrize(("shape", "mask_shape", "causal"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_kernel_matches_reference(ops, shape, mask_shape, causal, dtype):
    x, mask, grad = _inputs(shape, mask_shape, dtype)
    tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
    scale = 0.125
    y = ops.scaled_masked_softmax_fwd(x, mask, scale, causal)
    torch.testing.assert_close(y, scaled_masked_softmax_reference(x, mask, scale, causal), **tol)
    torch.testing.assert_close(
        ops.scaled_masked_softmax_bwd(grad, y, scale),
        scaled_masked_softmax_reference_backward(grad, y, scale),
        **tol,
    )


@requires_cpu_ext
@pytest.mark.parametrize(("shape", "mask_shape", "causal"), CASES[1::2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision(ops, shape, mask_shape, causal, dtype):
    x, mask, grad = _inputs(shape, mask_shape, dtype)
    tol = LOW_PRECISION_TOL[dtype]
    # fp32 reference on the same rounded inputs, so only the output rounding differs.
    x32, grad32 = x.float(), grad.float()
    y = ops.scaled_masked_softmax_fwd(x, mask, 0.5, causal)
    assert y.dtype == dtype
    torch.testing.assert_close(
        y.float(), scaled_masked_softmax_reference(x32, mask, 0.5, causal), **tol
    )
    grad_x = ops.scaled_masked_softmax_bwd(grad, y, 0.5)
    assert grad_x.dtype == dtype
    torch.testing.assert_close(
        grad_x.float(), scaled_masked_softmax_reference_backward(grad32, y.float(), 0.5), **tol
    )


@requires_cpu_ext
def test_cpu_kernel_fully_masked_rows_and_extremes(ops):
    x, _, grad = _inputs((2, 2, 4, 6), None, torch.float32)
    mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    mask[0, :, 2, :] = True  # one fully masked row
    mask[1, :, :, 3:] = True
    x[1, 0, 0, 0] = 1e30  # exp(scale·x) alone would overflow: the max subtraction must hold
    y = ops.scaled_masked_softmax_fwd(x, mask, 1.0, True)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0, :, 2], torch.zeros(2, 6))
    # Causal row 0 of batch 1 attends to key 0 only, which holds all the mass.
    assert y[1, 0, 0, 0] == 1.0
    torch.testing.assert_close(y, scaled_masked_softmax_reference(x, mask, 1.0, True), **FP32_TOL)
    grad_x = ops.scaled_masked_softmax_bwd(grad, y, 1.0)
    assert torch.equal(grad_x[0, :, 2], torch.zeros(2, 6))
    assert torch.equal(grad_x[mask.expand_as(x)], torch.zeros(int(mask.expand_as(x).sum())))


@requires_cpu_ext
def test_cpu_kernel_non_contiguous_and_empty(ops):
    x, mask, grad = _inputs((2, 3, 7, 5), (2, 1, 5, 7), torch.float32)
    xt, gradt = x.transpose(-1, -2), grad.transpose(-1, -2)  # [2, 3, 5, 7], non-contiguous
    mask_t = mask.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided mask view
    assert not xt.is_contiguous() and not mask_t.is_contiguous()
    y = ops.scaled_masked_softmax_fwd(xt, mask_t, 0.3, True)
    torch.testing.assert_close(y, scaled_masked_softmax_reference(xt, mask_t, 0.3, True))
    torch.testing.assert_close(
        ops.scaled_masked_softmax_bwd(gradt, y, 0.3),
        scaled_masked_softmax_reference_backward(gradt, y, 0.3),
        **FP32_TOL,
    )
    for shape in [(0, 2, 3, 4), (2, 2, 0, 4), (2, 2, 3, 0)]:
        empty = torch.empty(shape)
        assert ops.scaled_masked_softmax_fwd(empty, None, 1.0, False).shape == shape
        assert ops.scaled_masked_softmax_bwd(empty, empty, 1.0).shape == shape


@requires_cpu_ext
def test_cpu_kernel_is_deterministic(ops):
    # Each row is reduced in a fixed order by one task: the thread count cannot change the bits.
    x, mask, grad = _inputs((4, 4, 16, 300), (4, 1, 16, 300), torch.float32)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            y = ops.scaled_masked_softmax_fwd(x, mask, 0.1, True)
            results.append((y, ops.scaled_masked_softmax_bwd(grad, y, 0.1)))
    finally:
        torch.set_num_threads(threads)
    for y, grad_x in results[1:]:
        assert torch.equal(results[0][0], y) and torch.equal(results[0][1], grad_x)


@requires_cpu_ext
def test_cpu_kernel_rejects_bad_inputs(ops):
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match=r"scores must be 4-D \[b, heads, sq, sk\]"):
        ops.scaled_masked_softmax_fwd(torch.randn(3, 4, 5), None, 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        ops.scaled_masked_softmax_fwd(x, torch.zeros(2, 1, 4, 5), 1.0, False)
    with pytest.raises(RuntimeError, match=r"does not broadcast to the scores' shape"):
        ops.scaled_masked_softmax_fwd(x, torch.zeros(2, 1, 4, 6, dtype=torch.bool), 1.0, False)
    with pytest.raises(RuntimeError, match="causal masking needs sk >= sq"):
        ops.scaled_masked_softmax_fwd(torch.randn(1, 1, 5, 4), None, 1.0, True)
    with pytest.raises(RuntimeError, match="grad shape"):
        ops.scaled_masked_softmax_bwd(torch.randn(2, 3, 4, 6), x, 1.0)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.scaled_masked_softmax_bwd(x.double(), x, 1.0)


def test_public_function_rejects_bad_inputs():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"scores must be \[b, heads, sq, sk\]"):
        scaled_masked_softmax(torch.randn(4, 5), None, 1.0, False)
    with pytest.raises(ValueError, match="mask must be bool"):
        scaled_masked_softmax(x, torch.zeros(1, 1, 4, 5, dtype=torch.uint8), 1.0, False)
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_masked_softmax(x, torch.zeros(1, 2, 4, 5, dtype=torch.bool), 1.0, False)
    with pytest.raises(ValueError, match="causal masking needs sk >= sq"):
        scaled_masked_softmax(torch.randn(1, 1, 5, 4), None, 1.0, True)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_reference(causal):
    x, mask, _ = _inputs((2, 2, 4, 5), (2, 1, 4, 5), torch.float64)
    assert torch.autograd.gradcheck(
        lambda t: scaled_masked_softmax_reference(t, mask, 0.6, causal), (x.requires_grad_(True),)
    )


@pytest.mark.parametrize("fused", ["0", "1"])
def test_gradcheck_function(monkeypatch, fused, request):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, mask, _ = _inputs((2, 2, 4, 5), (2, 1, 4, 5), torch.float64)
    mask[0, 0, 1] = True  # a fully masked row: zero output and zero gradient
    expected_tier = "reference"
    if fused == "1" and os.environ.get("MEGAPP_BUILD_CPU_EXT") != "0":
        request.getfixturevalue("ops")  # the fused path must actually run the kernel
        expected_tier = "cpu"
    assert select_tier("scaled_masked_softmax", x) == expected_tier
    assert torch.autograd.gradcheck(
        lambda t: ScaledMaskedSoftmaxFunction.apply(t, mask, 0.6, True), (x.requires_grad_(True),)
    )


@pytest.mark.parametrize("fused", ["0", "1"])
def test_function_saves_only_its_output(monkeypatch, fused):
    monkeypatch.setenv("MEGAPP_FUSED", fused)
    x, mask, _ = _inputs((2, 2, 4, 5), (2, 1, 4, 5), torch.float32)
    x.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = scaled_masked_softmax(x, mask, 0.5, True)
    assert len(saved) == 1
    assert saved[0].data_ptr() == y.data_ptr() and saved[0].shape == y.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_masked_softmax_autograd_matches_reference(dtype):
    x, mask, grad = _inputs((2, 3, 5, 8), (2, 1, 5, 8), dtype)
    x.requires_grad_(True)
    y = scaled_masked_softmax(x, mask, 0.25, causal=True)
    y.backward(grad)
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    torch.testing.assert_close(
        y, scaled_masked_softmax_reference(x.detach(), mask, 0.25, True), **tol
    )
    torch.testing.assert_close(
        x.grad, scaled_masked_softmax_reference_backward(grad, y.detach(), 0.25), **tol
    )


def test_choose_tier():
    both = frozenset({"cpu", "cuda"})
    assert choose_tier("scaled_masked_softmax", "cpu", torch.float64, both) == "cpu"
    assert choose_tier("scaled_masked_softmax", "cuda", torch.bfloat16, both) == "cuda"
    assert choose_tier("scaled_masked_softmax", "cuda", torch.float64, both) == "reference"


# Row lengths that exercise each CUDA path: warp per row (sk ≤ 1024; 7 unvectorized, 64, 1000
# and 1024 in 16-byte packs), block per row (4096; 1500 for float32), streaming (20000; 1027;
# 1500 for 16-bit types, whose rows are not a whole number of 16-byte packs).
CUDA_CASES = [
    ((2, 3, 5, 7), (2, 1, 5, 7), True),
    ((2, 2, 16, 64), None, True),
    ((1, 2, 4, 1000), (1, 1, 4, 1000), False),
    ((1, 2, 8, 1024), (1, 1, 8, 1024), True),
    ((1, 2, 4, 4096), (1, 1, 1, 4096), True),
    ((1, 1, 3, 1500), (1, 1, 3, 1500), True),
    ((1, 1, 3, 1027), None, True),
    ((1, 1, 2, 20000), (1, 1, 2, 20000), True),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "mask_shape", "causal"), CUDA_CASES)
def test_cuda_kernel_matches_reference(dtype, shape, mask_shape, causal):
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    x, mask, grad = _inputs(shape, mask_shape, dtype)
    if mask is not None and mask.shape[-2] > 1:
        mask[..., 0, :] = True  # a fully masked row in every batch
    ops = torch.ops.megapp
    tol = FP32_TOL if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    # CUDA expf, FMA contraction and the tree-ordered row sums differ from the CPU by a few ulp.
    tol = {"rtol": 4 * tol["rtol"], "atol": 4 * tol["atol"]}
    mask_cuda = None if mask is None else mask.cuda()
    y = ops.scaled_masked_softmax_fwd(x.cuda(), mask_cuda, 0.3, causal)
    ref = scaled_masked_softmax_reference(x.float(), mask, 0.3, causal)
    torch.testing.assert_close(y.float().cpu(), ref, **tol)
    grad_x = ops.scaled_masked_softmax_bwd(grad.cuda(), y, 0.3)
    ref_grad = scaled_masked_softmax_reference_backward(grad.float(), y.float().cpu(), 0.3)
    torch.testing.assert_close(grad_x.float().cpu(), ref_grad, **tol)
    # Deterministic: a second run gives the same bits.
    assert torch.equal(y, ops.scaled_masked_softmax_fwd(x.cuda(), mask_cuda, 0.3, causal))
    assert torch.equal(grad_x, ops.scaled_masked_softmax_bwd(grad.cuda(), y, 0.3))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_unaligned_autograd():
    assert cuda_ops_available(), "megapp._C_cuda is not built; build with MEGAPP_BUILD_CUDA=1"
    shape = (1, 2, 4, 64)
    x64, mask, grad = _inputs(shape, (1, 1, 4, 64), torch.float64)
    # Scores 2 bytes past a 16-byte boundary: the unvectorized kernels must run.
    buf = torch.empty(x64.numel() + 1, dtype=torch.bfloat16, device="cuda")
    x = buf[1:].view(shape)
    x.copy_(x64)
    assert x.data_ptr() % 16 != 0
    x.requires_grad_(True)
    y = scaled_masked_softmax(x, mask.cuda(), 0.5, True)
    y.backward(grad.to("cuda", torch.bfloat16))
    tol = {k: 4 * v for k, v in LOW_PRECISION_TOL[torch.bfloat16].items()}
    x32 = x.detach().float().cpu()
    torch.testing.assert_close(
        y.float().cpu(), scaled_masked_softmax_reference(x32, mask, 0.5, True), **tol
    )
    # the kernel got the bf16-rounded gradient: so does the reference
    rounded = grad.to(torch.bfloat16).float()
    ref_grad = scaled_masked_softmax_reference_backward(rounded, y.detach().float().cpu(), 0.5)
    torch.testing.assert_close(x.grad.float().cpu(), ref_grad, **tol)
